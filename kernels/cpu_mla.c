/* Latent attention's absorbed decode form on CPU, reading the paged latent cache in place (no gather).
 * kernels/mla.py's module docstring has the math; kernels/mla_backends.py calls this through ctypes.
 *
 * Layout: the layer's cache is rows of `dim` (kv_lora_rank + qk_rope_head_dim) elements, the row of
 * position p of sequence s being tables[s][p / block_size] * block_size + p % block_size; the row holds
 * the token's latent (`rank` values) then its rotary key, and every head reads the same row. q is
 * [num_seqs, heads, dim] float32: each head's absorbed query (w_uk folded into q_nope, then q_rope).
 * out is [num_seqs, heads, rank] float32: each head's softmax mix of the latents (w_uv is applied after,
 * in torch). Sequence s has one query row, at position seq_lens[s] - 1, seeing positions 0..seq_lens[s]-1.
 *
 * Cache dtypes: float32 (0), bfloat16 (1), or 8-bit codes (2: int8, fp8 e4m3 or e5m2) read through `lut`,
 * the 256 float values of the codes (kernels/kv_quant.codes_to_float's), times their block's float32
 * scale in `scales` (one per block): the values the torch reference dequantizes to, bit for bit.
 *
 * Work item: one sequence and up to MLA_HEADS of its heads (fewer when there are fewer sequences than
 * threads). Keys are visited in tiles of MLA_TILE positions; a tile's rows are converted once to float32
 * (zero-padded to whole vectors) and then read by every head of the item from L1/L2, so the cache is read
 * once per item rather than once per head: 576 values per token for all of DeepSeek's heads. Per tile:
 * the scores of four heads by four keys at a time (sixteen FMA chains over the row, each row vector
 * loaded once for four heads and each query vector once for four keys, then horizontal sums), an online
 * softmax per head (running max and sum in float32, as flash-decoding does), and P.V over the rows'
 * first `rank` values for four heads by four vectors at a time, each row vector loaded once for four
 * heads. The attention is compute-bound here (a row read serves 2 x heads x (dim + rank) flops), so the
 * blocking is for fewer loads per FMA.
 *
 * A head's arithmetic depends on its own query and the cache alone (not on its item's other heads nor
 * on the thread count), so any thread count gives the same bits. Items are shared by `num_threads`
 * OpenMP threads through an atomic counter, on torch's thread team (kernels/cpu_native.py). Plain C
 * with GCC vector extensions (cpu_simd.h): AVX-512 where the build has it, else 8-float vectors.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_simd.h"

#define MLA_HEADS 16 /* heads of one item: their accumulators (16 x 512 floats) stay in L1/L2 */
#define MLA_TILE 32  /* keys per tile: a multiple of VW (the softmax exponentiates whole vectors) */
#define MLA_MAX_DIM 4096

typedef struct {
    const float *q;
    float *out;
    const void *cache;
    const float *scales, *lut;
    const int32_t *seq_lens, *tables;
    int32_t table_width, heads, dim, rank, block_size, dtype, head_chunk, chunks;
    float scale;
} MlaArgs;

typedef struct {
    float *rows, *q, *acc, *s, *m, *l, *alpha;
    int dp, rp; /* dim and rank rounded up to whole vectors */
} MlaScratch;

static void load_row(const MlaArgs *a, int32_t block, int32_t offset, float *dst, int dp) {
    const int d = a->dim;
    const int64_t row = (int64_t)block * a->block_size + offset;
    if (a->dtype == 0) {
        memcpy(dst, (const float *)a->cache + row * d, (size_t)d * sizeof(float));
    } else if (a->dtype == 1) {
        const uint16_t *src = (const uint16_t *)a->cache + row * d;
        for (int i = 0; i < d; i++) {
            union { uint32_t u; float f; } c = {.u = (uint32_t)src[i] << 16};
            dst[i] = c.f;
        }
    } else {
        const uint8_t *src = (const uint8_t *)a->cache + row * d;
        const float s = a->scales[block];
        for (int i = 0; i < d; i++) dst[i] = a->lut[src[i]] * s;
    }
    for (int i = d; i < dp; i++) dst[i] = 0.0f;
}

#define HB 4 /* heads sharing each row vector load */
#define KB 4 /* keys sharing each query vector load */
#define VB 4 /* accumulator vectors of each head per pass over the tile's rows */

/* s[h][j0 + k] = scale * q[h] . rows[j0 + k] for H heads and K keys: H x K FMA chains over the row,
 * each in the same order whatever H and K */
static inline __attribute__((always_inline)) void score_block(const float *q, const float *rows, int j0, int dp,
                                                              float scale, float *s, int H, int K) {
    vw c[HB][KB];
    for (int h = 0; h < H; h++)
        for (int k = 0; k < K; k++) c[h][k] = (vw){0};
    for (int d = 0; d < dp; d += VW) {
        vw r[KB];
        for (int k = 0; k < K; k++) r[k] = *(const vwu *)(rows + (int64_t)(j0 + k) * dp + d);
        for (int h = 0; h < H; h++) {
            const vw x = *(const vwu *)(q + (int64_t)h * dp + d);
            for (int k = 0; k < K; k++) c[h][k] += x * r[k];
        }
    }
    for (int h = 0; h < H; h++)
        for (int k = 0; k < K; k++) s[h * MLA_TILE + j0 + k] = hsumw(c[h][k]) * scale;
}

static void scores(const float *q, int nh, const float *rows, int nk, int dp, float scale, float *s) {
    int h = 0;
    for (; h + HB <= nh; h += HB) {
        int j = 0;
        for (; j + KB <= nk; j += KB) score_block(q + (int64_t)h * dp, rows, j, dp, scale, s + h * MLA_TILE, HB, KB);
        for (; j < nk; j++) score_block(q + (int64_t)h * dp, rows, j, dp, scale, s + h * MLA_TILE, HB, 1);
    }
    for (; h < nh; h++) {
        int j = 0;
        for (; j + KB <= nk; j += KB) score_block(q + (int64_t)h * dp, rows, j, dp, scale, s + h * MLA_TILE, 1, KB);
        for (; j < nk; j++) score_block(q + (int64_t)h * dp, rows, j, dp, scale, s + h * MLA_TILE, 1, 1);
    }
}

/* acc[h][r0 ..) = acc[h][r0 ..) * alpha[h] + sum_j p[h][j] rows[j][r0 ..) for H heads and V vectors: one
 * chain per head and vector, in the same order whatever H and V */
static inline __attribute__((always_inline)) void mix_block(float *acc, int rp, const float *p, const float *alpha,
                                                            const float *rows, int nk, int dp, int r0, int H, int V) {
    vw c[HB][VB];
    for (int h = 0; h < H; h++)
        for (int v = 0; v < V; v++) c[h][v] = *(const vwu *)(acc + (int64_t)h * rp + r0 + v * VW) * alpha[h];
    for (int j = 0; j < nk; j++) {
        vw x[VB];
        for (int v = 0; v < V; v++) x[v] = *(const vwu *)(rows + (int64_t)j * dp + r0 + v * VW);
        for (int h = 0; h < H; h++) {
            const vw pj = splatw(p[h * MLA_TILE + j]);
            for (int v = 0; v < V; v++) c[h][v] += pj * x[v];
        }
    }
    for (int h = 0; h < H; h++)
        for (int v = 0; v < V; v++) *(vwu *)(acc + (int64_t)h * rp + r0 + v * VW) = c[h][v];
}

static void mix(float *acc, int nh, int rp, const float *p, const float *alpha, const float *rows, int nk, int dp) {
    int h = 0;
    for (; h + HB <= nh; h += HB) {
        float *a = acc + (int64_t)h * rp;
        int r = 0;
        for (; r + VB * VW <= rp; r += VB * VW) mix_block(a, rp, p + h * MLA_TILE, alpha + h, rows, nk, dp, r, HB, VB);
        for (; r < rp; r += VW) mix_block(a, rp, p + h * MLA_TILE, alpha + h, rows, nk, dp, r, HB, 1);
    }
    for (; h < nh; h++) {
        float *a = acc + (int64_t)h * rp;
        int r = 0;
        for (; r + VB * VW <= rp; r += VB * VW) mix_block(a, rp, p + h * MLA_TILE, alpha + h, rows, nk, dp, r, 1, VB);
        for (; r < rp; r += VW) mix_block(a, rp, p + h * MLA_TILE, alpha + h, rows, nk, dp, r, 1, 1);
    }
}

static void mla_item(const MlaArgs *a, int64_t item, MlaScratch *w) {
    const int32_t seq = (int32_t)(item / a->chunks);
    const int32_t h0 = (int32_t)(item % a->chunks) * a->head_chunk;
    const int32_t nh = a->heads - h0 < a->head_chunk ? a->heads - h0 : a->head_chunk;
    const int dp = w->dp, rp = w->rp, bs = a->block_size;
    const int32_t len = a->seq_lens[seq];
    const int32_t *table = a->tables + (int64_t)seq * a->table_width;
    for (int h = 0; h < nh; h++) {
        float *q = w->q + (int64_t)h * dp;
        memcpy(q, a->q + ((int64_t)seq * a->heads + h0 + h) * a->dim, (size_t)a->dim * sizeof(float));
        for (int i = a->dim; i < dp; i++) q[i] = 0.0f;
        memset(w->acc + (int64_t)h * rp, 0, (size_t)rp * sizeof(float));
        w->m[h] = -INFINITY;
        w->l[h] = 0.0f;
    }
    for (int32_t t0 = 0; t0 < len; t0 += MLA_TILE) {
        const int nk = len - t0 < MLA_TILE ? len - t0 : MLA_TILE;
        for (int j = 0; j < nk; j++) {
            const int32_t pos = t0 + j;
            load_row(a, table[pos / bs], pos % bs, w->rows + (int64_t)j * dp, dp);
        }
        scores(w->q, nh, w->rows, nk, dp, a->scale, w->s);
        for (int h = 0; h < nh; h++) { /* online softmax: scores become probabilities (cpu_simd.h's exp) */
            float *s = w->s + h * MLA_TILE;
            float mx = w->m[h];
            for (int j = 0; j < nk; j++) mx = s[j] > mx ? s[j] : mx;
            w->alpha[h] = expf(w->m[h] - mx); /* 0 on the first tile: m is -inf, mx finite */
            for (int j = 0; j < nk; j += VW) *(vwu *)(s + j) = expw(*(const vwu *)(s + j) - mx);
            float sum = 0.0f;
            for (int j = 0; j < nk; j++) sum += s[j];
            w->l[h] = w->l[h] * w->alpha[h] + sum;
            w->m[h] = mx;
        }
        mix(w->acc, nh, rp, w->s, w->alpha, w->rows, nk, dp);
    }
    for (int h = 0; h < nh; h++) {
        const float inv = w->l[h] > 0.0f ? 1.0f / w->l[h] : 0.0f;
        const float *acc = w->acc + (int64_t)h * rp;
        float *out = a->out + ((int64_t)seq * a->heads + h0 + h) * a->rank;
        for (int r = 0; r < a->rank; r++) out[r] = acc[r] * inv;
    }
}

static int mla_work(const MlaArgs *a, int64_t items, int64_t *next) {
    MlaScratch w;
    w.dp = (a->dim + VW - 1) / VW * VW;
    w.rp = (a->rank + VW - 1) / VW * VW;
    const size_t hc = (size_t)a->head_chunk;
    float *buf = malloc(sizeof(float) * ((size_t)MLA_TILE * w.dp + hc * (w.dp + w.rp + MLA_TILE + 3)));
    if (buf == NULL) return -1;
    w.rows = buf;
    w.q = w.rows + (size_t)MLA_TILE * w.dp;
    w.acc = w.q + (size_t)a->head_chunk * w.dp;
    w.s = w.acc + hc * w.rp;
    w.m = w.s + hc * MLA_TILE;
    w.l = w.m + hc;
    w.alpha = w.l + hc;
    for (;;) {
        const int64_t i = __atomic_fetch_add(next, 1, __ATOMIC_RELAXED);
        if (i >= items) break;
        mla_item(a, i, &w);
    }
    free(buf);
    return 0;
}

/* Returns 0 on success, a negative code for arguments the kernel does not support. */
int32_t pdserve_mla_decode(const float *q, float *out, const void *cache, const float *scales, const float *lut,
                           const int32_t *seq_lens, const int32_t *tables, int32_t num_seqs, int32_t table_width,
                           int32_t heads, int32_t dim, int32_t rank, int32_t block_size, float scale, int32_t dtype,
                           int32_t num_threads) {
    if (dim <= 0 || dim > MLA_MAX_DIM || rank <= 0 || rank > dim) return -1;
    if (heads <= 0 || block_size <= 0 || num_seqs < 0) return -2;
    if (dtype < 0 || dtype > 2 || (dtype == 2 && (scales == NULL || lut == NULL))) return -3;
    if (num_seqs == 0) return 0;
    int threads = num_threads < 1 ? 1 : num_threads;
    /* as many heads per item as keep every thread busy, at most MLA_HEADS */
    int32_t chunk = heads < MLA_HEADS ? heads : MLA_HEADS;
    while (chunk > 1 && (int64_t)num_seqs * ((heads + chunk - 1) / chunk) < threads) chunk = (chunk + 1) / 2;
    const int32_t chunks = (heads + chunk - 1) / chunk;
    const MlaArgs args = {q, out, cache, scales, lut, seq_lens, tables, table_width, heads, dim, rank,
                          block_size, dtype, chunk, chunks, scale};
    const int64_t items = (int64_t)num_seqs * chunks;
    if (threads > items) threads = (int)items;
    int64_t next = 0;
    int failed = 0;
    if (threads <= 1) {
        failed = mla_work(&args, items, &next) != 0;
    } else {
#pragma omp parallel num_threads(threads) reduction(| : failed)
        failed = mla_work(&args, items, &next) != 0;
    }
    return failed ? -4 : 0;
}

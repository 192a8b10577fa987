/* Paged attention on CPU for prompt chunks: the blocked kernel (cpu_attention.c has the layout and the
 * row kernel, cpu_attention_plan.c the call that runs both).
 *
 * An item is BLK_TOKENS tokens of one sequence, every head. For each KV head, a tile of BLK_TILE keys
 * is gathered across KV blocks and transposed once (kt[d][j], 8x8 shuffles), so that four rows at a
 * time compute their scores as outer-product updates (each key vector loaded once for four rows, no
 * horizontal sums) and accumulate P.V the same way (each value vector loaded once for four rows), on
 * vectors of VW floats (cpu_simd.h): 16 where the build has AVX-512, else 8. Same online softmax, same
 * float32 accumulators as the row kernel; the summation order differs, so the two agree to float rounding,
 * not bitwise. A quantized cache's tile is converted to float32 rows first (cpu_kv_codes.c), and each row
 * then starts from its own exact key.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>

#include "cpu_internal.h"

#define BLK_ROWS (BLK_TOKENS * BLK_MAX_QPK)
#define BLK_TILE 64 /* keys per tile (gathered across KV blocks) */

static const float zero_row[MAX_HEAD_DIM]; /* a padding key's row (all bits 0: zero in either dtype) */

/* kt[d0 + i][0..7] = column d0 + i of the 8 rows (keys) k[0..7], for i in 0..7 */
static inline __attribute__((always_inline)) void transpose8(const char *const k[8], int d0, int esize, int bf16,
                                                             float *kt) {
    const i32x8 lo1 = {0, 8, 1, 9, 4, 12, 5, 13}, hi1 = {2, 10, 3, 11, 6, 14, 7, 15};
    const i32x8 lo2 = {0, 1, 8, 9, 4, 5, 12, 13}, hi2 = {2, 3, 10, 11, 6, 7, 14, 15};
    const i32x8 lo4 = {0, 1, 2, 3, 8, 9, 10, 11}, hi4 = {4, 5, 6, 7, 12, 13, 14, 15};
    v8 r[8], t[8], u[8];
    for (int i = 0; i < 8; i++) r[i] = load8(k[i] + d0 * esize, bf16);
    for (int i = 0; i < 4; i++) {
        t[2 * i] = __builtin_shuffle(r[2 * i], r[2 * i + 1], lo1);
        t[2 * i + 1] = __builtin_shuffle(r[2 * i], r[2 * i + 1], hi1);
    }
    for (int h = 0; h < 8; h += 4) {
        u[h] = __builtin_shuffle(t[h], t[h + 2], lo2);
        u[h + 1] = __builtin_shuffle(t[h], t[h + 2], hi2);
        u[h + 2] = __builtin_shuffle(t[h + 1], t[h + 3], lo2);
        u[h + 3] = __builtin_shuffle(t[h + 1], t[h + 3], hi2);
    }
    for (int i = 0; i < 4; i++) {
        *(v8u *)(kt + (d0 + i) * BLK_TILE) = __builtin_shuffle(u[i], u[i + 4], lo4);
        *(v8u *)(kt + (d0 + i + 4) * BLK_TILE) = __builtin_shuffle(u[i], u[i + 4], hi4);
    }
}

/* Vectors of VW lanes a group of four rows handles at once (in the score and the P.V loops): 4 where the
 * build has 32 registers (AVX-512: 16 accumulators), else 2. Each key or value vector is loaded into a
 * register once for the four rows (the empty asm keeps the compiler from folding a load into each row's
 * FMA, which would load it four times). Each row's own arithmetic is the same for any width, bitwise. Four
 * vectors and loads kept in registers took a 1,024-token prompt's attention in a layer of SmolLM2 1.12x
 * faster, on one thread or two (bench.lab.kernel_ab). */
#define GROUP_VECS (VW == 16 ? 4 : 2)

/* nv (2 or 4) vectors of VW floats from p on (float32 or bfloat16 elements of esize bytes), held in
 * registers: the empty asm keeps each from being loaded again into every row's FMA */
typedef struct {
    vw v[4];
} held4;

static inline __attribute__((always_inline)) held4 hold(const char *p, int esize, int bf16, const int nv) {
    vw x0 = loadw(p, bf16), x1 = loadw(p + VW * esize, bf16), x2 = x0, x3 = x1;
    if (nv > 2) x2 = loadw(p + 2 * VW * esize, bf16), x3 = loadw(p + 3 * VW * esize, bf16);
    __asm__("" : "+v"(x0), "+v"(x1), "+v"(x2), "+v"(x3));
    return (held4){{x0, x1, x2, x3}};
}

/* Four rows' scores against nv * VW keys of the transposed tile: s[r][c] = sum_d q[r][d] kt[d][c]. */
static inline __attribute__((always_inline)) void scores4(const float *q, const float *kt, float *p, int hd,
                                                          int c0, const int nv) {
    vw s[4][4] = {{{0}}};
    for (int d = 0; d < hd; d++) {
        const held4 k = hold((const char *)(kt + d * BLK_TILE + c0), sizeof(float), 0, nv);
        for (int r = 0; r < 4; r++) {
            const float b = q[r * hd + d];
            for (int v = 0; v < nv; v++) s[r][v] += b * k.v[v];
        }
    }
    for (int r = 0; r < 4; r++)
        for (int v = 0; v < nv; v++) *(vw *)(p + r * BLK_TILE + c0 + v * VW) = s[r][v];
}

/* Four rows' outputs over nv * VW dimensions from column dc: acc[r] = acc[r] * alpha[r] + sum_j p[r][j] v_j */
static inline __attribute__((always_inline)) void values4(float *acc, const float *alpha, const float *p,
                                                          const char *const *vrow, int n, int hd, int dc,
                                                          int esize, int bf16, const int nv) {
    vw o[4][4];
    for (int r = 0; r < 4; r++)
        for (int v = 0; v < nv; v++) o[r][v] = *(vw *)(acc + r * hd + dc + v * VW) * alpha[r];
    for (int j = 0; j < n; j++) {
        const held4 x = hold(vrow[j] + dc * esize, esize, bf16, nv);
        for (int r = 0; r < 4; r++) {
            const float pj = p[r * BLK_TILE + j];
            for (int v = 0; v < nv; v++) o[r][v] += pj * x.v[v];
        }
    }
    for (int r = 0; r < 4; r++)
        for (int v = 0; v < nv; v++) *(vw *)(acc + r * hd + dc + v * VW) = o[r][v];
}

static inline __attribute__((always_inline)) void attend_block(const Args *a, const BlockItem *it, int hd,
                                                               int bf16) {
    float kt[MAX_HEAD_DIM * BLK_TILE] __attribute__((aligned(64)));
    float qbuf[BLK_ROWS * MAX_HEAD_DIM] __attribute__((aligned(64)));
    float acc[BLK_ROWS * MAX_HEAD_DIM] __attribute__((aligned(64)));
    float p[BLK_ROWS * BLK_TILE] __attribute__((aligned(64)));
    float m[BLK_ROWS], l[BLK_ROWS], alpha[BLK_ROWS];
    int32_t last[BLK_ROWS];
    const v8 neg_inf = {-INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY};
    const i32x8 lane = {0, 1, 2, 3, 4, 5, 6, 7};

    const int esize = bf16 ? 2 : 4;
    const int quant = pdserve_kv_row_bytes(a) != 0;
    /* a quantized cache: each tile's K rows (then its V rows) of one KV head converted to float32 */
    float *conv = quant ? pdserve_kv_scratch(2 * BLK_TILE * hd) : NULL;
    const int qpk = a->num_heads / a->kv_heads;
    const int s = it->seq;
    const int q0 = a->query_start_loc[s];
    const int q_len = a->query_start_loc[s + 1] - q0;
    const int ctx = a->seq_lens[s] - q_len;
    const int ntok = it->tok1 - it->tok0;
    const int nrows = ntok * qpk;           /* row r: token tok0 + r / qpk, head g * qpk + r % qpk */
    const int prows = (nrows + 3) & ~3;     /* padded to whole groups of four (padding rows see no key) */
    const int bs = a->block_size;
    const int64_t key_stride = (int64_t)a->kv_heads * hd;
    const int64_t block_stride = 2 * (int64_t)bs * key_stride;
    const int32_t *table = a->block_tables + (int64_t)s * a->table_width;
    const char *kv = (const char *)a->kv;
    const int max_last = ctx + it->tok1 - 1 - quant; /* a quantized cache: own keys come first, exact */

    for (int g = 0; g < a->kv_heads; g++) {
        for (int r = 0; r < prows; r++) {
            if (r < nrows) {
                const int tok = it->tok0 + r / qpk, head = g * qpk + r % qpk;
                const int64_t q_off = (int64_t)(q0 + tok) * a->q_token_stride + (int64_t)head * hd;
                for (int d = 0; d < hd; d++) qbuf[r * hd + d] = load1(a->q, q_off + d, bf16) * a->scale;
                last[r] = ctx + tok;
            } else {
                for (int d = 0; d < hd; d++) qbuf[r * hd + d] = 0.0f;
                last[r] = -1;
            }
            for (int d = 0; d < hd; d++) acc[r * hd + d] = 0.0f;
            m[r] = -INFINITY;
            l[r] = 0.0f;
            if (quant && r < nrows) { /* its own key first, exact; then the cached keys before it */
                pdserve_kv_own(a, q0 + it->tok0 + r / qpk, g, qbuf + r * hd, m + r, l + r, acc + r * hd);
                last[r]--;
            }
        }
        for (int start = 0; start <= max_last; start += BLK_TILE) {
            const int n = max_last + 1 - start < BLK_TILE ? max_last + 1 - start : BLK_TILE;
            const int npad = (n + 2 * VW - 1) & ~(2 * VW - 1);
            const char *krow[BLK_TILE], *vrow[BLK_TILE]; /* each key's K and V rows (the tile spans blocks) */
            if (quant) pdserve_kv_tile(a, table, start, n, g, g, conv, hd, (int64_t)BLK_TILE * hd);
            for (int j = 0; j < n && quant; j++) {
                krow[j] = (const char *)(conv + (int64_t)j * hd);
                vrow[j] = (const char *)(conv + (int64_t)(BLK_TILE + j) * hd);
            }
            for (int j = 0; j < n && !quant; j++) {
                const int pos = start + j;
                const int64_t row = (int64_t)table[pos / bs] * block_stride + (int64_t)(pos % bs) * key_stride +
                                    (int64_t)g * hd;
                krow[j] = kv + row * esize;
                vrow[j] = kv + (row + (int64_t)bs * key_stride) * esize;
            }
            for (int j = n; j < npad; j++) krow[j] = (const char *)zero_row; /* padding keys: zeros */
            for (int j0 = 0; j0 < npad; j0 += 8) {
                for (int d0 = 0; d0 < hd; d0 += 8) transpose8(krow + j0, d0, esize, bf16, kt + j0);
            }
            for (int r0 = 0; r0 < prows; r0 += 4) {
                int group_last = last[r0];
                for (int r = r0 + 1; r < r0 + 4; r++) group_last = last[r] > group_last ? last[r] : group_last;
                if (group_last < start) continue; /* no row of the four sees a key of this tile */
                for (int c0 = 0; c0 < n;) { /* whole groups of vectors, then pairs (npad: whole pairs) */
                    const int wide = c0 + GROUP_VECS * VW <= npad;
                    if (wide) scores4(qbuf + r0 * hd, kt, p + r0 * BLK_TILE, hd, c0, GROUP_VECS);
                    else scores4(qbuf + r0 * hd, kt, p + r0 * BLK_TILE, hd, c0, 2);
                    c0 += (wide ? GROUP_VECS : 2) * VW;
                }
                for (int r = r0; r < r0 + 4; r++) {
                    float *pr = p + r * BLK_TILE;
                    int nv = last[r] + 1 - start;
                    if (nv > n) nv = n;
                    if (nv <= 0) { /* no key of this tile: nothing to add */
                        alpha[r] = 1.0f;
                        for (int j0 = 0; j0 < n; j0 += 8) *(v8 *)(pr + j0) = (v8){0};
                        continue;
                    }
                    v8 vmax = neg_inf;
                    for (int j0 = 0; j0 < nv; j0 += 8) {
                        const i32x8 keep = lane < (nv - j0);
                        const v8 sc = (v8)(((i32x8) * (v8 *)(pr + j0) & keep) | ((i32x8)neg_inf & ~keep));
                        vmax = vmax8(vmax, sc);
                    }
                    float mt = m[r];
                    for (int u = 0; u < 8; u++) mt = vmax[u] > mt ? vmax[u] : mt;
                    alpha[r] = exp8((v8){0} + (m[r] - mt))[0]; /* m = -inf at first: ~1e-38 * 0 */
                    v8 vsum = {0};
                    for (int j0 = 0; j0 < n; j0 += 8) {
                        const i32x8 keep = lane < (nv - j0);
                        const v8 e = (v8)((i32x8)exp8(*(v8 *)(pr + j0) - mt) & keep);
                        *(v8 *)(pr + j0) = e;
                        vsum += e;
                    }
                    l[r] = l[r] * alpha[r] + hsum(vsum);
                    m[r] = mt;
                }
                for (int dc = 0; dc < hd;) { /* hd: whole pairs of vectors (BLK_HEAD_DIM_STEP) */
                    const int wide = dc + GROUP_VECS * VW <= hd;
                    if (wide) values4(acc + r0 * hd, alpha + r0, p + r0 * BLK_TILE, vrow, n, hd, dc, esize, bf16,
                                      GROUP_VECS);
                    else values4(acc + r0 * hd, alpha + r0, p + r0 * BLK_TILE, vrow, n, hd, dc, esize, bf16, 2);
                    dc += (wide ? GROUP_VECS : 2) * VW;
                }
            }
        }
        for (int r = 0; r < nrows; r++) {
            const int tok = it->tok0 + r / qpk, head = g * qpk + r % qpk;
            const int64_t out_off = ((int64_t)(q0 + tok) * a->num_heads + head) * hd;
            const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
            for (int d = 0; d < hd; d++) store1(a->out, out_off + d, acc[r * hd + d] * inv, bf16);
            if (a->m_out) {
                a->m_out[out_off / hd] = m[r];
                a->l_out[out_off / hd] = l[r];
            }
        }
    }
}

static void block_f32_64(const Args *a, const BlockItem *it) { attend_block(a, it, 64, 0); }
static void block_f32_128(const Args *a, const BlockItem *it) { attend_block(a, it, 128, 0); }
static void block_f32_any(const Args *a, const BlockItem *it) { attend_block(a, it, a->head_dim, 0); }
static void block_bf16_64(const Args *a, const BlockItem *it) { attend_block(a, it, 64, 1); }
static void block_bf16_128(const Args *a, const BlockItem *it) { attend_block(a, it, 128, 1); }
static void block_bf16_any(const Args *a, const BlockItem *it) { attend_block(a, it, a->head_dim, 1); }

/* (a quantized cache takes the float32 kernels: they read its rows converted) */
block_fn pdserve_block_pick(const Args *a) {
    const int bf16 = a->dtype == DTYPE_BF16;
    if (a->head_dim == 64) return bf16 ? block_bf16_64 : block_f32_64;
    if (a->head_dim == 128) return bf16 ? block_bf16_128 : block_f32_128;
    return bf16 ? block_bf16_any : block_f32_any;
}

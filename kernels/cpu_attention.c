/* Paged attention on CPU, reading K/V in place from the paged cache (no gather).
 *
 * Layout (kernels/attention.py): the layer's cache is [num_blocks, 2, block_size,
 * kv_heads, head_dim] (K at index 0 of dim 1, V at 1); q and out are
 * [num_tokens, num_heads, head_dim] (q's token stride may be larger, for views).
 * Sequence s owns query rows query_start_loc[s]..query_start_loc[s+1]; its new
 * token i sits at position seq_lens[s] - q_len + i and sees keys at positions <= its own.
 *
 * Work item: one sequence, one KV head, and up to MAX_ROWS (token, query head)
 * rows of that KV head, so each K/V row loaded serves every query head of the
 * group (GQA) and every token of a prefill chunk. Keys are visited block by block
 * with an online softmax (running max m, running sum l, float32 accumulators), as
 * flash-decoding does. Items are shared by `num_threads` OpenMP threads through an
 * atomic counter: the library links libgomp.so.1, which resolves to the copy torch
 * loaded, so the kernel runs on torch's own thread team rather than starting threads
 * that would compete with torch's spinning ones. Cache, q and out are float32 (dtype 0) or bfloat16 (dtype 1).
 *
 * Prompt chunks (a sequence with at least BLK_MIN_QLEN new tokens) take the blocked kernel of
 * cpu_attention_blocked.c instead; one call runs both kinds of item on one thread team.
 *
 * Plain C with GCC vector extensions (8 floats; the blocked kernel 16 where the build has AVX-512),
 * so it builds on x86_64 and aarch64.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "cpu_internal.h"

#define MAX_ROWS 32
#define MAX_HEAD_DIM 256
#define KEY_TILE 32
#define PF_DIST 1 /* tiles ahead to prefetch (1 measured best; 2 and 3 no better) */

/* lane u of the result is the sum of the lanes of a[u] */
static inline v8 reduce8(const v8 a[8]) {
    const i32x8 even = {0, 8, 2, 10, 4, 12, 6, 14}, odd = {1, 9, 3, 11, 5, 13, 7, 15};
    const i32x8 lo2 = {0, 1, 8, 9, 4, 5, 12, 13}, hi2 = {2, 3, 10, 11, 6, 7, 14, 15};
    const i32x8 lo4 = {0, 1, 2, 3, 8, 9, 10, 11}, hi4 = {4, 5, 6, 7, 12, 13, 14, 15};
    v8 x[4], y[2];
    for (int i = 0; i < 4; i++) {
        x[i] = __builtin_shuffle(a[2 * i], a[2 * i + 1], even) + __builtin_shuffle(a[2 * i], a[2 * i + 1], odd);
    }
    for (int i = 0; i < 2; i++) {
        y[i] = __builtin_shuffle(x[2 * i], x[2 * i + 1], lo2) + __builtin_shuffle(x[2 * i], x[2 * i + 1], hi2);
    }
    return __builtin_shuffle(y[0], y[1], lo4) + __builtin_shuffle(y[0], y[1], hi4);
}

/* One work item; `hd` and `bf16` are compile-time constants in each specialisation. */
static inline __attribute__((always_inline)) void attend_item(const Args *a, const Item *it, int hd, int bf16) {
    float qbuf[MAX_ROWS * MAX_HEAD_DIM] __attribute__((aligned(32)));
    float acc[MAX_ROWS * MAX_HEAD_DIM] __attribute__((aligned(32)));
    float scores[KEY_TILE] __attribute__((aligned(32)));
    float m[MAX_ROWS], l[MAX_ROWS];
    int32_t last[MAX_ROWS]; /* last visible key position of each row */
    int64_t out_off[MAX_ROWS];
    int32_t kv_off[MAX_ROWS]; /* bytes from a key row of KV head 0 to this row's KV head */

    const int esize = bf16 ? 2 : 4;
    const int qpk = a->num_heads / a->kv_heads;
    const int s = it->seq;
    const int q0 = a->query_start_loc[s];
    const int q_len = a->query_start_loc[s + 1] - q0;
    const int seq_len = a->seq_lens[s];
    const int ctx = seq_len - q_len;
    const int nrows = it->row_end - it->row_begin;
    const int bs = a->block_size;
    const int64_t key_stride = (int64_t)a->kv_heads * hd;     /* elements between consecutive keys */
    const int64_t block_stride = 2 * (int64_t)bs * key_stride; /* elements between blocks */
    const int32_t *table = a->block_tables + (int64_t)s * a->table_width;
    const char *kv = (const char *)a->kv;

    int max_last = -1;
    /* the KV heads this item reads, for prefetching: a range within one token, else all */
    int g_first = 0, g_span = a->kv_heads;
    if (it->row_begin / a->num_heads == (it->row_end - 1) / a->num_heads) {
        g_first = (it->row_begin % a->num_heads) / qpk;
        g_span = ((it->row_end - 1) % a->num_heads) / qpk - g_first + 1;
    }
    for (int r = 0; r < nrows; r++) {
        const int row = it->row_begin + r;
        const int tok = row / a->num_heads;
        const int head = row % a->num_heads;
        kv_off[r] = (head / qpk) * hd * esize;
        const int64_t q_off = (int64_t)(q0 + tok) * a->q_token_stride + (int64_t)head * hd;
        for (int d = 0; d < hd; d++) qbuf[r * hd + d] = load1(a->q, q_off + d, bf16) * a->scale;
        for (int d = 0; d < hd; d++) acc[r * hd + d] = 0.0f;
        out_off[r] = ((int64_t)(q0 + tok) * a->num_heads + head) * hd;
        last[r] = ctx + tok;
        if (last[r] > max_last) max_last = last[r];
        m[r] = -INFINITY;
        l[r] = 0.0f;
    }

    /* tiles never cross a block: the tile size divides block_size (both powers of two) */
    const int tile = bs < KEY_TILE ? bs : KEY_TILE;
    for (int start = 0; start <= max_last; start += tile) {
        const int blk = start / bs, off = start % bs;
        const int n = max_last + 1 - start < tile ? max_last + 1 - start : tile;
        const int64_t base = (int64_t)table[blk] * block_stride + (int64_t)off * key_stride;
        const char *kbase = kv + base * esize;
        const char *vbase = kv + (base + (int64_t)bs * key_stride) * esize;
        const int64_t kstep = key_stride * esize;
        /* prefetch the next tile's K/V rows of this item's KV heads, spread over the rows' work */
        const char *pf_k = kbase, *pf_v = vbase;
        int64_t pf_lines = 0, pf_done = 0;
        if (start + PF_DIST * tile <= max_last) {
            const int nstart = start + PF_DIST * tile;
            const int nn = max_last + 1 - nstart < tile ? max_last + 1 - nstart : tile;
            const int64_t nbase = (int64_t)table[nstart / bs] * block_stride +
                                  (int64_t)(nstart % bs) * key_stride + (int64_t)g_first * hd;
            pf_k = kv + nbase * esize;
            pf_v = pf_k + (int64_t)bs * key_stride * esize;
            pf_lines = ((nn - 1) * kstep + (int64_t)g_span * hd * esize + 63) / 64;
        }

        for (int r = 0; r < nrows; r++) {
            for (const int64_t to = pf_lines * (r + 1) / nrows; pf_done < to; pf_done++) {
                __builtin_prefetch(pf_k + 64 * pf_done, 0, 3);
                __builtin_prefetch(pf_v + 64 * pf_done, 0, 3);
            }
            int nv = last[r] + 1 - start;
            if (nv <= 0) continue;
            if (nv > n) nv = n;
            const float *qr = qbuf + r * hd;
            const char *kp = kbase + kv_off[r];
            const char *vp = vbase + kv_off[r];
            /* scores of 8 keys at a time: one FMA chain per key, then a transposing reduction */
            v8 vmax = {-INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY};
            for (int j0 = 0; j0 < nv; j0 += 8) {
                const char *kj[8];
                for (int u = 0; u < 8; u++) kj[u] = kp + (j0 + u < nv ? j0 + u : nv - 1) * kstep;
                v8 dots[8] = {{0}};
                for (int d = 0; d < hd; d += 8) {
                    const v8 qd = *(const v8 *)(qr + d);
                    for (int u = 0; u < 8; u++) dots[u] += qd * load8(kj[u] + d * esize, bf16);
                }
                v8 sc = reduce8(dots);
                *(v8 *)(scores + j0) = sc;
                vmax = vmax8(vmax, sc); /* repeated keys never raise the max */
            }
            float mt = m[r];
            for (int u = 0; u < 8; u++) mt = vmax[u] > mt ? vmax[u] : mt;
            const float alpha = exp8((v8){0} + (m[r] - mt))[0]; /* m = -inf at first: ~1e-38 * 0 */
            v8 vsum = {0};
            for (int j0 = 0; j0 < nv; j0 += 8) {
                v8 p = exp8(*(v8 *)(scores + j0) - mt);
                if (j0 + 8 > nv) {
                    for (int u = nv - j0; u < 8; u++) p[u] = 0.0f;
                }
                *(v8 *)(scores + j0) = p;
                vsum += p;
            }
            l[r] = l[r] * alpha + hsum(vsum);
            m[r] = mt;
            float *ar = acc + r * hd;
            for (int dc = 0; dc < hd; dc += 64) {
                const int w = hd - dc < 64 ? (hd - dc) / 8 : 8;
                v8 o[8];
                for (int u = 0; u < w; u++) o[u] = *(v8 *)(ar + dc + 8 * u) * alpha;
                for (int j = 0; j < nv; j++) {
                    const float pj = scores[j];
                    const char *vj = vp + j * kstep + dc * esize;
                    for (int u = 0; u < w; u++) o[u] += pj * load8(vj + 8 * u * esize, bf16);
                }
                for (int u = 0; u < w; u++) *(v8 *)(ar + dc + 8 * u) = o[u];
            }
        }
    }

    for (int r = 0; r < nrows; r++) {
        const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
        for (int d = 0; d < hd; d++) store1(a->out, out_off[r] + d, acc[r * hd + d] * inv, bf16);
    }
}

static void attend_f32_64(const Args *a, const Item *it) { attend_item(a, it, 64, 0); }
static void attend_f32_128(const Args *a, const Item *it) { attend_item(a, it, 128, 0); }
static void attend_f32_any(const Args *a, const Item *it) { attend_item(a, it, a->head_dim, 0); }
static void attend_bf16_64(const Args *a, const Item *it) { attend_item(a, it, 64, 1); }
static void attend_bf16_128(const Args *a, const Item *it) { attend_item(a, it, 128, 1); }
static void attend_bf16_any(const Args *a, const Item *it) { attend_item(a, it, a->head_dim, 1); }

attend_fn pdserve_attend_pick(const Args *a) {
    const int bf16 = a->dtype == DTYPE_BF16;
    if (a->head_dim == 64) return bf16 ? attend_bf16_64 : attend_f32_64;
    if (a->head_dim == 128) return bf16 ? attend_bf16_128 : attend_f32_128;
    return bf16 ? attend_bf16_any : attend_f32_any;
}

/* Whether sequence s takes the blocked kernel (see the header comment). */
static int blocked(const Args *a, int s) {
    return a->query_start_loc[s + 1] - a->query_start_loc[s] >= BLK_MIN_QLEN &&
           a->num_heads / a->kv_heads <= BLK_MAX_QPK && a->head_dim % BLK_HEAD_DIM_STEP == 0;
}

int64_t pdserve_plan_items(const int32_t *query_start_loc, int32_t num_seqs, int32_t num_heads, int32_t per_item,
                           Item *items) {
    if (per_item <= 0 || per_item > MAX_ROWS) {
        per_item = num_heads <= MAX_ROWS ? (MAX_ROWS / num_heads) * num_heads : MAX_ROWS;
    }
    int64_t k = 0;
    for (int s = 0; s < num_seqs; s++) {
        const int rows = (query_start_loc[s + 1] - query_start_loc[s]) * num_heads;
        for (int r0 = 0; r0 < rows; r0 += per_item, k++) {
            if (items) items[k] = (Item){s, r0, r0 + per_item < rows ? r0 + per_item : rows};
        }
    }
    return k;
}

int pdserve_plan_attention(const Args *a, int32_t num_seqs, int32_t per_item, Plan *plan) {
    int64_t num_blocks = 0, num_items = 0;
    for (int s = 0; s < num_seqs; s++) {
        const int q_len = a->query_start_loc[s + 1] - a->query_start_loc[s];
        if (blocked(a, s)) {
            num_blocks += (q_len + BLK_TOKENS - 1) / BLK_TOKENS;
        } else {
            num_items += pdserve_plan_items(a->query_start_loc + s, 1, a->num_heads, per_item, NULL);
        }
    }
    *plan = (Plan){(BlockItem *)malloc((size_t)(num_blocks + 1) * sizeof(BlockItem)),
                   (Item *)malloc((size_t)(num_items + 1) * sizeof(Item)),
                   num_blocks, num_items, pdserve_attend_pick(a), pdserve_block_pick(a)};
    if (!plan->blocks || !plan->items) {
        pdserve_plan_free(plan);
        return -5;
    }
    int64_t nb = 0, ni = 0;
    for (int s = 0; s < num_seqs; s++) {
        const int q_len = a->query_start_loc[s + 1] - a->query_start_loc[s];
        if (blocked(a, s)) {
            for (int t = 0; t < q_len; t += BLK_TOKENS, nb++) {
                plan->blocks[nb] = (BlockItem){s, t, t + BLK_TOKENS < q_len ? t + BLK_TOKENS : q_len};
            }
        } else {
            const int64_t k = pdserve_plan_items(a->query_start_loc + s, 1, a->num_heads, per_item, plan->items + ni);
            for (int64_t i = ni; i < ni + k; i++) plan->items[i].seq = s;
            ni += k;
        }
    }
    return 0;
}

void pdserve_plan_free(Plan *plan) {
    free(plan->blocks);
    free(plan->items);
    plan->blocks = NULL;
    plan->items = NULL;
}

void pdserve_plan_work(const Args *a, const Plan *plan, int32_t *next) {
    for (;;) {
        const int64_t i = __atomic_fetch_add(next, 1, __ATOMIC_RELAXED);
        if (i >= plan->num_blocks + plan->num_items) break;
        if (i < plan->num_blocks) {
            plan->block(a, &plan->blocks[i]);
        } else {
            plan->attend(a, &plan->items[i - plan->num_blocks]);
        }
    }
}

/* Returns 0 on success, a negative code for arguments the kernel does not support. */
int pdserve_paged_attention(const void *q, int64_t q_token_stride, const void *kv, void *out,
                            const int32_t *query_start_loc, const int32_t *seq_lens,
                            const int32_t *block_tables, int32_t num_seqs, int32_t table_width,
                            int32_t num_heads, int32_t kv_heads, int32_t head_dim, int32_t block_size,
                            float scale, int32_t dtype, int32_t num_threads) {
    if (head_dim <= 0 || head_dim % 16 != 0 || head_dim > MAX_HEAD_DIM) return -1;
    if (kv_heads <= 0 || num_heads % kv_heads != 0) return -2;
    if (block_size <= 0 || (block_size & (block_size - 1)) != 0) return -3;
    if (dtype != DTYPE_F32 && dtype != DTYPE_BF16) return -4;
    const Args args = {q, kv, out, query_start_loc, seq_lens, block_tables, q_token_stride,
                       table_width, num_heads, kv_heads, head_dim, block_size, dtype, scale};
    /* blocked items for prompt chunks, row items of as many whole tokens as fit for the rest */
    Plan plan;
    if (pdserve_plan_attention(&args, num_seqs, 0, &plan) != 0) return -5;
    const int64_t work = plan.num_blocks + plan.num_items;
    int32_t next = 0;
    int threads = num_threads < 1 ? 1 : num_threads;
    if (threads > work) threads = (int)work;
    if (threads <= 1) {
        pdserve_plan_work(&args, &plan, &next);
    } else {
#pragma omp parallel num_threads(threads)
        pdserve_plan_work(&args, &plan, &next);
    }
    pdserve_plan_free(&plan);
    return 0;
}

/* Attention mass per KV block on CPU, for heavy-hitter eviction (engine/kv_eviction.py): what the torch
 * reference's explicit softmax adds to kernels/torch_ref.py's `mass`, computed after the attention call.
 *
 * The attention kernels (cpu_attention.c, cpu_attention_blocked.c) hand out each query row's running max m
 * and sum l (Args.m_out, Args.l_out; row t * num_heads + h). This pass scores every key a row saw again
 * (q already scaled, against the key as the kernel read it: in place, converted from a quantized cache, or
 * the row's own exact key there) and adds exp(s - m) / l, the key's probability, to its block's mass of
 * the row's KV head: mass[block * stride + g] (the caller points `mass` at its layer's first KV head, so a
 * block's row holds every layer's and KV head's mass). An item is MASS_SLOTS blocks of one sequence's
 * table: its sums run over the sequence's new tokens and each KV head's query heads in a fixed order, and
 * one thread then adds the items' sums to the blocks in item order, so the masses do not depend on the
 * thread count (and a block in two tables gets both shares). pdserve_attention_mass runs a per-layer call;
 * the one-call decoder (cpu_decoder.c) runs the same items after each layer's attention.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_internal.h"

#define MASS_KEYS VW /* keys scored together: one vector exp */

/* Item `it`'s blocks' probabilities over every new token and query head of its sequence, per KV head g,
 * into acc[(slot - slot0) * kv_heads + g], in a fixed order. `hd` and `bf16` (the cache's, 0 for a quantized one's converted
 * rows) are compile-time constants in each specialisation. */
static inline __attribute__((always_inline)) void mass_body(const Args *a, const MassItem *it, float *acc, int hd,
                                                            int kb) {
    const int bs = a->block_size, qpk = a->num_heads / a->kv_heads;
    const int bf16 = a->dtype == DTYPE_BF16, quant = pdserve_kv_row_bytes(a) != 0;
    const int esize = bf16 ? 2 : 4;
    const int s = it->seq;
    const int q0 = a->query_start_loc[s], q_len = a->query_start_loc[s + 1] - q0;
    const int ctx = a->seq_lens[s] - q_len;
    const int32_t *table = a->block_tables + (int64_t)s * a->table_width;
    const int64_t key_bytes = (int64_t)a->kv_heads * hd * esize, block_bytes = 2 * (int64_t)bs * key_bytes;
    const int k_lo = it->slot0 * bs, shift = __builtin_ctz((unsigned)bs); /* bs: a power of two */
    float qbuf[MASS_MAX_QPK * MAX_HEAD_DIM] __attribute__((aligned(64))); /* a KV head's query rows */
    float *conv = quant ? pdserve_kv_scratch((int64_t)MASS_KEYS * 2 * hd) : NULL;
    for (int j = 0; j < (it->slot1 - it->slot0) * a->kv_heads; j++) acc[j] = 0.0f;
    for (int tok = 0; tok < q_len; tok++) {
        const int pos = ctx + tok;
        const int k_hi = it->slot1 * bs - 1 < pos ? it->slot1 * bs - 1 : pos; /* last key of the item it sees */
        if (k_hi < k_lo) continue;
        for (int g = 0; g < a->kv_heads; g++) {
            float m[MASS_MAX_QPK], inv[MASS_MAX_QPK];
            for (int i = 0; i < qpk; i++) {
                const int head = g * qpk + i;
                const int64_t row = (int64_t)(q0 + tok) * a->num_heads + head;
                const int64_t q_off = (int64_t)(q0 + tok) * a->q_token_stride + (int64_t)head * hd;
                for (int d = 0; d < hd; d++) qbuf[i * hd + d] = load1(a->q, q_off + d, bf16) * a->scale;
                m[i] = a->m_out[row];
                inv[i] = a->l_out[row] > 0.0f ? 1.0f / a->l_out[row] : 0.0f;
            }
            for (int p0 = k_lo; p0 <= k_hi; p0 += MASS_KEYS) {
                const int n = k_hi + 1 - p0 < MASS_KEYS ? k_hi + 1 - p0 : MASS_KEYS;
                const char *krow[MASS_KEYS];
                if (quant) { /* converted rows; the row's own key exact */
                    pdserve_kv_tile(a, table, p0, n, g, g, conv, 2 * hd, hd);
                    for (int j = 0; j < n; j++) krow[j] = (const char *)(conv + (int64_t)j * 2 * hd);
                    if (pos - p0 < n) {
                        memcpy(conv + (int64_t)(pos - p0) * 2 * hd,
                               a->k_new + (q0 + tok) * a->new_stride + (int64_t)g * hd, (size_t)hd * 4);
                    }
                } else {
                    for (int j = 0; j < n; j++) {
                        const int p = p0 + j;
                        krow[j] = (const char *)a->kv + table[p >> shift] * block_bytes +
                                  (int64_t)(p & (bs - 1)) * key_bytes + (int64_t)g * hd * esize;
                    }
                }
                for (int j = n; j < MASS_KEYS; j++) krow[j] = krow[n - 1]; /* scored, never added */
                const int kes = kb ? 2 : 4;
                for (int i = 0; i < qpk; i++) {
                    vw dots[MASS_KEYS]; /* one FMA chain per key, then a transposing reduction */
                    for (int j = 0; j < MASS_KEYS; j++) {
                        vw dot = *(const vw *)(qbuf + i * hd) * loadw(krow[j], kb);
                        for (int d = VW; d < hd; d += VW) {
                            dot += *(const vw *)(qbuf + i * hd + d) * loadw(krow[j] + d * kes, kb);
                        }
                        dots[j] = dot;
                    }
                    const vw e = expw(reducew(dots) - m[i]) * inv[i];
                    for (int j = 0; j < n; j++) acc[(((p0 + j) >> shift) - it->slot0) * a->kv_heads + g] += e[j];
                }
            }
        }
    }
}

static void mass_f32_64(const Args *a, const MassItem *it, float *acc) { mass_body(a, it, acc, 64, 0); }
static void mass_f32_128(const Args *a, const MassItem *it, float *acc) { mass_body(a, it, acc, 128, 0); }
static void mass_f32_any(const Args *a, const MassItem *it, float *acc) { mass_body(a, it, acc, a->head_dim, 0); }
static void mass_bf16_any(const Args *a, const MassItem *it, float *acc) { mass_body(a, it, acc, a->head_dim, 1); }

int pdserve_mass_plan(const Args *a, int32_t num_seqs, MassPlan *plan) {
    int64_t items = 0;
    for (int s = 0; s < num_seqs; s++) {
        items += (a->seq_lens[s] + MASS_SLOTS * a->block_size - 1) / (MASS_SLOTS * a->block_size);
    }
    *plan = (MassPlan){(MassItem *)malloc((size_t)(items + 1) * sizeof(MassItem)),
                       (float *)malloc((size_t)(items + 1) * MASS_SLOTS * a->kv_heads * sizeof(float)), items, NULL};
    if (!plan->items || !plan->sums) {
        pdserve_mass_free(plan);
        return -5;
    }
    int64_t k = 0;
    for (int s = 0; s < num_seqs; s++) {
        const int slots = (a->seq_lens[s] + a->block_size - 1) / a->block_size;
        for (int c = 0; c < slots; c += MASS_SLOTS, k++) {
            plan->items[k] = (MassItem){s, c, c + MASS_SLOTS < slots ? c + MASS_SLOTS : slots};
        }
    }
    plan->item = a->dtype == DTYPE_BF16 ? mass_bf16_any
                 : a->head_dim == 64    ? mass_f32_64
                 : a->head_dim == 128   ? mass_f32_128
                                        : mass_f32_any;
    return 0;
}

void pdserve_mass_free(MassPlan *plan) {
    free(plan->items);
    free(plan->sums);
    plan->items = NULL;
    plan->sums = NULL;
}

void pdserve_mass_work(const Args *a, const MassPlan *plan, int64_t i) {
    plan->item(a, &plan->items[i], plan->sums + i * MASS_SLOTS * a->kv_heads);
}

void pdserve_mass_add(const Args *a, const MassPlan *plan, float *mass, int64_t stride) {
    const int kvh = a->kv_heads;
    for (int64_t i = 0; i < plan->num_items; i++) {
        const MassItem *it = &plan->items[i];
        const int32_t *table = a->block_tables + (int64_t)it->seq * a->table_width;
        const float *sums = plan->sums + i * MASS_SLOTS * kvh;
        for (int slot = it->slot0; slot < it->slot1; slot++) {
            float *row = mass + (int64_t)table[slot] * stride;
            for (int g = 0; g < kvh; g++) row[g] += sums[(slot - it->slot0) * kvh + g];
        }
    }
}

int pdserve_attention_mass(const void *q, int64_t q_token_stride, const void *kv, const int32_t *query_start_loc,
                           const int32_t *seq_lens, const int32_t *block_tables, int32_t num_seqs,
                           int32_t table_width, int32_t num_heads, int32_t kv_heads, int32_t head_dim,
                           int32_t block_size, float scale, int32_t dtype, const float *scales, const float *k_new,
                           const float *m_rows, const float *l_rows, float *mass, int64_t mass_stride,
                           int32_t num_threads) {
    if (head_dim <= 0 || head_dim % 16 != 0 || head_dim > MAX_HEAD_DIM) return -1;
    if (kv_heads <= 0 || num_heads % kv_heads != 0 || num_heads / kv_heads > MASS_MAX_QPK) return -2;
    if (block_size <= 0 || (block_size & (block_size - 1)) != 0) return -3;
    if (dtype < DTYPE_F32 || dtype > DTYPE_INT4 || (dtype >= DTYPE_INT8 && (!scales || !k_new))) return -4;
    const Args args = {q, kv, NULL, query_start_loc, seq_lens, block_tables, q_token_stride, table_width,
                       num_heads, kv_heads, head_dim, block_size, dtype, scale, scales, k_new, NULL,
                       (int64_t)kv_heads * head_dim, (float *)m_rows, (float *)l_rows};
    MassPlan plan;
    if (pdserve_mass_plan(&args, num_seqs, &plan) != 0) return -5;
    int threads = num_threads < 1 ? 1 : num_threads;
    if (threads > plan.num_items) threads = (int)(plan.num_items > 0 ? plan.num_items : 1);
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
    for (int64_t i = 0; i < plan.num_items; i++) pdserve_mass_work(&args, &plan, i);
    pdserve_mass_add(&args, &plan, mass, mass_stride);
    pdserve_mass_free(&plan);
    return 0;
}

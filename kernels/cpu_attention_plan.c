/* Paged attention on CPU: the plan of one call and the call itself (cpu_attention.c has the layout and
 * the row kernel, cpu_attention_blocked.c the blocked kernel of prompt chunks).
 *
 * A call's work is blocked items (BLK_TOKENS tokens, every head) for the sequences that take the blocked
 * kernel and row items for the rest, run on one OpenMP team through an atomic counter, blocked items
 * first. pdserve_paged_attention plans row items of as many whole tokens as fit; the one-call decoder
 * (cpu_decoder.c) plans one token's KV head group per item, from the same code, so both send the same
 * sequences to the same kernel and agree bitwise.
 */
#include <stdint.h>
#include <stdlib.h>

#include "cpu_internal.h"

/* Whether sequence s takes the blocked kernel (see the header comment). */
static int blocked(const Args *a, int s) {
    return a->query_start_loc[s + 1] - a->query_start_loc[s] >= BLK_MIN_QLEN &&
           a->num_heads / a->kv_heads <= BLK_MAX_QPK && a->head_dim % BLK_HEAD_DIM_STEP == 0;
}

int64_t pdserve_plan_items(const int32_t *query_start_loc, int32_t num_seqs, int32_t num_heads, int32_t per_item,
                           Item *items) {
    if (per_item <= 0 || per_item > ITEM_MAX_ROWS) {
        per_item = num_heads <= ITEM_MAX_ROWS ? (ITEM_MAX_ROWS / num_heads) * num_heads : ITEM_MAX_ROWS;
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

/* Returns 0 on success, a negative code for arguments the kernel does not support. dtype is the cache's
 * format (cpu_internal.h's DTYPE_*); a quantized one comes with its scales and the step's K and V in
 * float32 ([num_tokens, kv_heads, head_dim]; cpu_kv_codes.c). m_rows and l_rows, when set, receive each
 * query row's final running max and sum (row token * num_heads + head), for cpu_attention_mass.c. */
int pdserve_paged_attention(const void *q, int64_t q_token_stride, const void *kv, void *out,
                            const int32_t *query_start_loc, const int32_t *seq_lens,
                            const int32_t *block_tables, int32_t num_seqs, int32_t table_width,
                            int32_t num_heads, int32_t kv_heads, int32_t head_dim, int32_t block_size,
                            float scale, int32_t dtype, const float *scales, const float *k_new,
                            const float *v_new, float *m_rows, float *l_rows, int32_t num_threads) {
    if (head_dim <= 0 || head_dim % 16 != 0 || head_dim > MAX_HEAD_DIM) return -1;
    if (kv_heads <= 0 || num_heads % kv_heads != 0) return -2;
    if (block_size <= 0 || (block_size & (block_size - 1)) != 0) return -3;
    if (dtype < DTYPE_F32 || dtype > DTYPE_INT4) return -4;
    if (dtype >= DTYPE_INT8 && (!scales || !k_new || !v_new)) return -4;
    const Args args = {q, kv, out, query_start_loc, seq_lens, block_tables, q_token_stride, table_width,
                       num_heads, kv_heads, head_dim, block_size, dtype, scale, scales, k_new, v_new,
                       (int64_t)kv_heads * head_dim, m_rows, l_rows};
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

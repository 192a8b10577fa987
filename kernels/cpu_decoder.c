/* Every decoder layer of a few-row float32 step, and the final norm, in one call on one OpenMP team.
 *
 * kernels/native_decoder.py holds the contract (arguments, layout, when it applies). Per layer, with a
 * barrier between the phases that read what another thread wrote:
 *   1. x = rms_norm(hidden += delta)            rows split over the threads
 *   2. qkv = x . Wqkv^T (+ bias)                output features split
 *   3. rope on q and k, then k and v into the paged cache at the step's slots   tokens split
 *   4. attention over the paged cache            items taken in turn (cpu_attention.c's plan: blocked
 *      items for prompt chunks, one token's KV head group each for the rest)
 *   5. delta = attn . Wo^T                       features split
 *   6. x = rms_norm(hidden += delta)             rows split
 *   7. gate/up = x . Wgu^T, act = silu(gate) * up   the same features of gate and up per thread, so
 *      the activation needs no barrier of its own
 *   8. delta = act . Wdown^T                     features split
 * and after the last layer out = rms_norm(hidden += delta) * final_norm.
 *
 * The four matrices are packed (cpu_packed.c's layout, cpu_qpacked.c's GGUF blocks, bitwise the same products
 * as their dequantized float panels, or cpu_bf16.c's bfloat16 panels) and the products split by whole panels, so the
 * intermediate width must be a multiple of PANEL (gate and up panels then line up with the activation's
 * share). Every value is computed by the same code as the per-op calls (cpu_packed.c, cpu_ops.c,
 * cpu_attention.c) in the same order, so the result is bitwise that of the per-op path: a product's
 * output does not depend on the split, SiLU takes the same vector spans (the shares are multiples of 8),
 * and an attention row's arithmetic does not depend on the item it is in. What it saves is the per-op cost of a
 * decode step: ~10 ctypes calls, torch allocations and fork/joins of the thread team per layer.
 */
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_internal.h"

/* per layer: pointers to the tensors, then the four matrices' formats (cpu_internal.h's WF_*), one byte each
 * from the lowest: qkv, o, gate/up, down (WF_F32: cpu_packed.c's panels; WF_BF16: cpu_bf16.c's; the others
 * cpu_qpacked.c's blocks, with WF_I8 set where the product takes int8 activations, cpu_qint8.c) */
enum { W_INPUT_NORM, W_QKV, W_QKV_BIAS, W_O, W_POST_NORM, W_GATE_UP, W_DOWN, W_FORMATS, W_PER_LAYER };
#define FORMAT(lw, i) ((int32_t)((lw[W_FORMATS] >> (8 * (i))) & 0xff))

/* thread t's share [*q0, *q1) of the panels of n output features, as evenly as they go */
static inline void panel_share(int64_t n, int t, int nt, int64_t *q0, int64_t *q1) {
    const int64_t panels = (n + PANEL - 1) / PANEL;
    *q0 = panels * t / nt;
    *q1 = panels * (t + 1) / nt;
}

static inline void norm_rows(float *hidden, const float *delta, const float *weight, float *out, int64_t rows,
                             int64_t dim, float eps, int t, int nt) {
    for (int64_t r = t; r < rows; r += nt) {
        pdserve_add_rms_norm_row(hidden + r * dim, delta ? delta + r * dim : 0, weight, out + r * dim, dim, eps);
    }
}

/* gate/up panels g0..g1-1 of the gate half and the same of the up half: int8 activations quantized once */
static void gate_and_up(int32_t fmt, const void *w, const float *x, float *gate_up, int64_t T, int64_t I,
                        int64_t H, int64_t g0, int64_t g1) {
    const int64_t gate_panels = I / PANEL;
    const QRows *a = (fmt & WF_I8) ? pdserve_quantize_rows(WF_KIND(fmt), x, T, H) : 0;
    if (a) {
        pdserve_i8_panels(WF_KIND(fmt), (const uint8_t *)w, a, 0, gate_up, 2 * I, g0, g1);
        pdserve_i8_panels(WF_KIND(fmt), (const uint8_t *)w, a, 0, gate_up, 2 * I, gate_panels + g0, gate_panels + g1);
        return;
    }
    pdserve_any_panels(fmt, w, x, 0, gate_up, T, 2 * I, H, g0, g1);
    pdserve_any_panels(fmt, w, x, 0, gate_up, T, 2 * I, H, gate_panels + g0, gate_panels + g1);
}

/* Returns 0, or a negative code for arguments it does not take (nothing is written then). */
int pdserve_decoder_f32(const int64_t *layer_weights, int32_t num_layers, void *kv_cache, int64_t kv_layer_bytes,
                        int32_t kv_format, float *kv_scales, int64_t scales_layer_floats, float *hidden, float *out, float *work, const float *cos_t, const float *sin_t,
                        const int64_t *write_rows, const int32_t *query_start_loc, const int32_t *seq_lens,
                        const int32_t *block_tables, int32_t num_seqs, int32_t table_width, int64_t tokens,
                        int32_t hidden_size, int32_t num_heads, int32_t kv_heads, int32_t head_dim,
                        int32_t intermediate, int32_t block_size, float scale, float eps, const float *final_norm,
                        float *mass, int32_t num_threads) {
    if (head_dim <= 0 || head_dim % 16 != 0 || head_dim > MAX_HEAD_DIM) return -1;
    if (kv_heads <= 0 || num_heads % kv_heads != 0) return -2;
    if (block_size <= 0 || (block_size & (block_size - 1)) != 0) return -3;
    if (tokens < 1) return -4;
    if (intermediate % PANEL != 0) return -6;
    if (kv_format != DTYPE_F32 && (kv_format < DTYPE_INT8 || kv_format > DTYPE_INT4 || !kv_scales)) return -7;
    const int quant = kv_format != DTYPE_F32;
    const int64_t T = tokens, H = hidden_size, I = intermediate, hd = head_dim;
    const int64_t q_width = (int64_t)num_heads * hd, kv_width = (int64_t)kv_heads * hd;
    const int64_t qkv_width = q_width + 2 * kv_width;
    float *x = work, *qkv = x + T * H, *attn = qkv + T * qkv_width, *gate_up = attn + T * q_width;
    float *act = gate_up + T * 2 * I, *delta = act + T * I;

    /* a quantized cache reads each row's own K and V from qkv, exact (cpu_kv_codes.c) */
    Args args = {qkv, kv_cache, attn, query_start_loc, seq_lens, block_tables, qkv_width,
                 table_width, num_heads, kv_heads, head_dim, block_size, kv_format, scale,
                 NULL, qkv + q_width, qkv + q_width + kv_width, qkv_width, NULL, NULL};
    /* row items of one token's KV head group (the most items to share), blocked ones for prompt chunks as
     * the per-op call plans them */
    Plan plan;
    if (pdserve_plan_attention(&args, num_seqs, num_heads / kv_heads, &plan) != 0) return -5;
    int32_t *taken = (int32_t *)calloc((size_t)num_layers + 1, sizeof(int32_t)); /* each layer's item counter */
    /* a quantized cache's write: the slots (block * block_size + offset) and runs of tokens in one block */
    int64_t *slots = quant ? (int64_t *)malloc((size_t)(2 * T + 1) * sizeof(int64_t)) : NULL;
    if (!taken || (quant && !slots)) {
        pdserve_plan_free(&plan);
        free(taken);
        free(slots);
        return -5;
    }
    /* --kv-eviction: each row's softmax max and sum, then the blocks' mass per layer and KV head (`mass`:
     * [blocks, num_layers * kv_heads], cpu_attention_mass.c) */
    float *stats = mass ? (float *)malloc((size_t)(2 * T * num_heads) * sizeof(float)) : NULL;
    MassPlan mplan = {NULL, NULL, 0, NULL};
    if (mass) {
        args.m_out = stats;
        args.l_out = stats ? stats + T * num_heads : NULL;
    }
    if (mass && (!stats || num_heads / kv_heads > MASS_MAX_QPK || pdserve_mass_plan(&args, num_seqs, &mplan) != 0)) {
        pdserve_plan_free(&plan);
        free(taken);
        free(slots);
        free(stats);
        return -5;
    }
    int64_t write_tasks = 0;
    if (quant) {
        for (int64_t tok = 0; tok < T; tok++) {
            slots[tok] = write_rows[tok] / (2 * block_size) * block_size + write_rows[tok] % (2 * block_size);
        }
        write_tasks = pdserve_kv_runs(slots, T, block_size, slots + T) * 2 * kv_heads;
    }
    const int threads = num_threads < 1 ? 1 : num_threads;

#pragma omp parallel num_threads(threads)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        int64_t q0, q1, h0, h1, g0, g1; /* panels; h0..h1: this thread's share of the hidden width (O, down) */
        panel_share(qkv_width, t, nt, &q0, &q1);
        panel_share(H, t, nt, &h0, &h1);
        panel_share(I, t, nt, &g0, &g1);
        for (int layer = 0; layer < num_layers; layer++) {
            const int64_t *lw = layer_weights + (int64_t)layer * W_PER_LAYER;
            const void *w_qkv = (const void *)lw[W_QKV], *w_gu = (const void *)lw[W_GATE_UP];
            const float *bias = (const float *)lw[W_QKV_BIAS];
            char *kv = (char *)kv_cache + layer * kv_layer_bytes;
            norm_rows(hidden, layer ? delta : 0, (const float *)lw[W_INPUT_NORM], x, T, H, eps, t, nt);
#pragma omp barrier
            pdserve_any_panels(FORMAT(lw, 0), w_qkv, x, bias, qkv, T, qkv_width, H, q0, q1);
#pragma omp barrier
            for (int64_t tok = t; tok < T; tok += nt) {
                float *row = qkv + tok * qkv_width;
                pdserve_rope_token(row, cos_t + tok * hd, sin_t + tok * hd, num_heads + kv_heads, head_dim);
                if (quant) continue;
                float *rows = (float *)kv;
                memcpy(rows + write_rows[tok] * kv_width, row + q_width, (size_t)kv_width * sizeof(float));
                memcpy(rows + (write_rows[tok] + block_size) * kv_width, row + q_width + kv_width,
                       (size_t)kv_width * sizeof(float));
            }
            float *layer_scales = quant ? kv_scales + layer * scales_layer_floats : NULL;
            if (quant) { /* each (block, part, KV head) requantized with the roped rows */
#pragma omp barrier
                const KvWrite w = {(uint8_t *)kv, layer_scales, {qkv + q_width, qkv + q_width + kv_width}, qkv_width,
                                   kv_format, block_size, kv_heads, head_dim};
                for (int64_t task = t; task < write_tasks; task += nt) pdserve_kv_write_task(&w, slots, slots + T, task);
            }
#pragma omp barrier
            {
                Args la = args;
                la.kv = kv;
                la.scales = layer_scales;
                pdserve_plan_work(&la, &plan, &taken[layer]);
            }
#pragma omp barrier
            if (mass) { /* the keys scored again, items split by thread; one thread adds them in order */
                Args la = args;
                la.kv = kv;
                la.scales = layer_scales;
                for (int64_t i = t; i < mplan.num_items; i += nt) pdserve_mass_work(&la, &mplan, i);
#pragma omp barrier
                if (t == 0) pdserve_mass_add(&la, &mplan, mass + (int64_t)layer * kv_heads, (int64_t)num_layers * kv_heads);
            }
            pdserve_any_panels(FORMAT(lw, 1), (const void *)lw[W_O], attn, 0, delta, T, H, q_width, h0, h1);
#pragma omp barrier
            norm_rows(hidden, delta, (const float *)lw[W_POST_NORM], x, T, H, eps, t, nt);
#pragma omp barrier
            gate_and_up(FORMAT(lw, 2), w_gu, x, gate_up, T, I, H, g0, g1);
            for (int64_t r = 0; r < T; r++) {
                const float *g = gate_up + r * 2 * I;
                pdserve_silu_mul_range(g, g + I, act + r * I, g0 * PANEL, g1 * PANEL);
            }
#pragma omp barrier
            pdserve_any_panels(FORMAT(lw, 3), (const void *)lw[W_DOWN], act, 0, delta, T, H, I, h0, h1);
#pragma omp barrier
        }
        norm_rows(hidden, num_layers ? delta : 0, final_norm, out, T, H, eps, t, nt);
    }
    pdserve_plan_free(&plan);
    pdserve_mass_free(&mplan);
    free(taken);
    free(slots);
    free(stats);
    return 0;
}

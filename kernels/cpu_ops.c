/* The decoder's per-layer small ops and the few-row product of decode steps, float32, on CPU.
 *
 * Built into the same library as cpu_attention.c (kernels/cpu_native.py) and called
 * through ctypes; kernels/native_ops.py holds the contract of each function and the
 * torch expression it stands for. Threads come from OpenMP: the library links
 * libgomp.so.1, which the dynamic loader resolves to the copy torch already loaded,
 * so these kernels run on torch's own thread team (no second pool spinning against it).
 *
 * Rope and the norm are compiled without FMA contraction (NO_CONTRACT): rope and the
 * residual add are then bitwise equal to the torch expressions they replace; the norm,
 * SiLU and the product differ from torch by rounding only.
 */

#include <math.h>
#include <omp.h>
#include <stdint.h>

#include "cpu_internal.h"


#define NO_CONTRACT __attribute__((optimize("fp-contract=off")))

static inline v8 ld(const float *p) { return *(const v8u *)p; }
static inline void st(float *p, v8 x) { *(v8u *)p = x; }

static inline float hsum8(v8 a) {
    return ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7]));
}

/* Y[m, n] = X[m, k] . W[n, k]^T (+ bias[n]) for the few rows of a decode step. W is row-major as
 * torch holds it ([out, in]) and is read in place, once: the threads split the output features in
 * contiguous ranges of 4, and each block of 4 weight rows (4k floats, in L1) is multiplied by the
 * activation rows 3 at a time, 12 AVX2 accumulators summing along k (one horizontal sum per output
 * at the end). While a block is in use, the block PF_AHEAD blocks further on is prefetched into L2
 * (prefetcht1), one instruction per cache line, spread evenly over the block's row groups, so the
 * DRAM stream overlaps the arithmetic. Into L2 rather than L1: an L1 prefetch holds one of the core's
 * few line-fill buffers for a whole DRAM round trip, which capped each core's stream at 8-10 GB/s while
 * it computed; the block's first row group then reads it from L2. Against the L1 prefetch of the next
 * block (four instructions a k step), every product of the model took 49.5-52.5 ms against 55.3-55.9
 * at 10 rows on one thread and 66.4 against 69.8-70.2 at 16, on huge pages (2-core Xeon, AVX-512;
 * docs/benchmarks.md, "Weights prefetched into L2 in the few-row product"). The empty
 * asm statements pin the loaded vectors to registers (otherwise GCC re-reads each one from memory for
 * every FMA that uses it). */
static inline v8 fma8(v8 a, v8 b, v8 c) { return a * b + c; }
#define PF_AHEAD 2                                   /* blocks of 4 weight rows ahead of the one in use */
#define PREFETCH_L2(p) __builtin_prefetch((p), 0, 2) /* prefetcht1 */
/* one k step's part of a row group's prefetch share: a line, or two when `two`, until pn lines are done */
#define PREFETCH_SHARE(two)                \
    do {                                   \
        if (pn > 0) {                      \
            PREFETCH_L2(pf);               \
            if (two) PREFETCH_L2(pf + 16); \
            pf += 16 * ((two) + 1);        \
            pn -= (two) + 1;               \
        }                                  \
    } while (0)

/* pairwise sums within 128-bit lanes (vhaddps): [a0+a1, a2+a3, b0+b1, b2+b3 | a4+a5, a6+a7, b4+b5, b6+b7] */
static inline v8 hadd8(v8 a, v8 b) {
    const i32x8 even = {0, 2, 8, 10, 4, 6, 12, 14}, odd = {1, 3, 9, 11, 5, 7, 13, 15};
    return __builtin_shuffle(a, b, even) + __builtin_shuffle(a, b, odd);
}

/* lanes u and u + 4 of the result add up to the sum of the lanes of the u-th argument */
static inline v8 sum4(v8 a, v8 b, v8 c, v8 d) { return hadd8(hadd8(a, b), hadd8(c, d)); }
#define PIN(v) __asm__("" : "+x"(v))

/* With AVX-512 the k loop runs 16 floats a step on 512-bit accumulators first, folded into the 8-wide
 * ones (low half + high half) before the 8-wide tail and the horizontal sums. Twice the arithmetic
 * per instruction: at 16 rows the product is bound by its FMAs, not by the weight stream. The order of
 * the sums then differs from the AVX2 build's, by rounding only; both paths of one build (per-op and
 * whole-decoder, kernels/cpu_decoder.c) run this same code, so they stay bitwise equal. */
#if defined(__AVX512F__)
typedef float v16 __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4), may_alias));
static inline v16 ld16(const float *p) { return *(const v16u *)p; }
static inline v8 lo8(v16 a) { return __builtin_shufflevector(a, a, 0, 1, 2, 3, 4, 5, 6, 7); }
static inline v8 hi8(v16 a) { return __builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15); }
#define PIN16(v) __asm__("" : "+v"(v))
#define WIDE_STEPS(WR, MR)                                                                            \
    if (kv >= 16) {                                                                                   \
        v16 wacc[WR][MR];                                                                             \
        for (int a = 0; a < WR; a++)                                                                  \
            for (int b = 0; b < MR; b++) wacc[a][b] = (v16){0};                                       \
        for (; i + 16 <= kv; i += 16) {                                                               \
            PREFETCH_SHARE(pwide);                                                            \
            v16 xv[MR];                                                                               \
            for (int b = 0; b < MR; b++) {                                                            \
                xv[b] = ld16(x + b * k + i);                                                          \
                PIN16(xv[b]);                                                                         \
            }                                                                                         \
            for (int a = 0; a < WR; a++) {                                                            \
                v16 q = ld16(w + a * k + i);                                                          \
                PIN16(q);                                                                             \
                for (int b = 0; b < MR; b++) wacc[a][b] = q * xv[b] + wacc[a][b];                     \
            }                                                                                         \
        }                                                                                             \
        for (int a = 0; a < WR; a++)                                                                  \
            for (int b = 0; b < MR; b++) acc[a][b] = lo8(wacc[a][b]) + hi8(wacc[a][b]);               \
    }
#else
#define WIDE_STEPS(WR, MR)
#endif

#define GEMM_BLOCK(WR, MR)                                                                            \
    static inline void block_##WR##x##MR(const float *w, const float *x, float *y, int64_t k,          \
                                         int64_t kv, int64_t ldy, const float *bias, const float *pf,  \
                                         int64_t pn, int pwide, int pnarrow) {                        \
        v8 acc[WR][MR];                                                                               \
        for (int a = 0; a < WR; a++)                                                                  \
            for (int b = 0; b < MR; b++) acc[a][b] = (v8){0};                                         \
        int64_t i = 0;                                                                                \
        (void)pwide; /* read by WIDE_STEPS only */                                                    \
        WIDE_STEPS(WR, MR)                                                                            \
        for (; i < kv; i += 8) {                                                                      \
            PREFETCH_SHARE(pnarrow);                                                          \
            v8 xv[MR];                                                                                \
            for (int b = 0; b < MR; b++) {                                                            \
                xv[b] = ld(x + b * k + i);                                                            \
                PIN(xv[b]);                                                                           \
            }                                                                                         \
            for (int a = 0; a < WR; a++) {                                                            \
                v8 q = ld(w + a * k + i);                                                             \
                PIN(q);                                                                               \
                for (int b = 0; b < MR; b++) acc[a][b] = fma8(q, xv[b], acc[a][b]);                   \
            }                                                                                         \
        }                                                                                             \
        for (int b = 0; b < MR; b++) {                                                                \
            float sums[WR];                                                                           \
            if (WR == 4) {                                                                            \
                const v8 r = sum4(acc[0][b], acc[1][b], acc[2][b], acc[3 % WR][b]);                   \
                for (int a = 0; a < WR; a++) sums[a] = r[a] + r[a + 4];                               \
            } else {                                                                                  \
                for (int a = 0; a < WR; a++) sums[a] = hsum8(acc[a][b]);                              \
            }                                                                                         \
            for (int a = 0; a < WR; a++) {                                                            \
                float s = sums[a];                                                                    \
                for (int64_t i = kv; i < k; i++) s += w[a * k + i] * x[b * k + i];                    \
                y[b * ldy + a] = bias ? s + bias[a] : s;                                              \
            }                                                                                         \
        }                                                                                             \
    }
GEMM_BLOCK(4, 1)
GEMM_BLOCK(4, 2)
GEMM_BLOCK(4, 3)
GEMM_BLOCK(1, 1)
GEMM_BLOCK(1, 2)
GEMM_BLOCK(1, 3)

/* One activation row (a batch-1 decode step): each weight row is read front to back, so each thread's
 * share of the weight is one sequential stream, summed in 4 accumulators along k. The 4-row blocks
 * below read four rows at once (four streams 4k floats apart, with software prefetch): at one row this
 * path took 7-10% less time over every product of the model (2 threads, interleaved: 20.6 ms against
 * 22.0 best, 22.2 against 24.8 median; docs/benchmarks.md, "Decode step time"). The stream is
 * prefetched into L2 ROW_PF_AHEAD floats ahead (16 KB, across row ends), one instruction per line: a
 * batch-1 step took 21.8-23.1 ms against 24.1-25.3 with the hardware prefetcher alone (2 threads, huge
 * pages, alternating; "Weights prefetched into L2 in the few-row product"). An L1 prefetch of the
 * next lines had only slowed it. */
#define ROW_PF_AHEAD 4096
static void gemv_features(const float *w, const float *x, const float *bias, float *y, int64_t k, int64_t r0,
                          int64_t r1) {
    const int64_t k32 = k & ~(int64_t)31, kv = k & ~(int64_t)7;
    for (int64_t r = r0; r < r1; r++) {
        const float *wr = w + r * k;
        v8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
        int64_t i = 0;
        for (; i < k32; i += 32) {
            PREFETCH_L2(wr + i + ROW_PF_AHEAD);
            PREFETCH_L2(wr + i + ROW_PF_AHEAD + 16);
            a0 = fma8(ld(wr + i), ld(x + i), a0);
            a1 = fma8(ld(wr + i + 8), ld(x + i + 8), a1);
            a2 = fma8(ld(wr + i + 16), ld(x + i + 16), a2);
            a3 = fma8(ld(wr + i + 24), ld(x + i + 24), a3);
        }
        for (; i < kv; i += 8) a0 = fma8(ld(wr + i), ld(x + i), a0);
        float s = hsum8((a0 + a1) + (a2 + a3));
        for (; i < k; i++) s += wr[i] * x[i];
        y[r] = bias ? s + bias[r] : s;
    }
}

/* Output features r0..r1 of every row: weight blocks of 4 (then single rows at the end of n). */
void pdserve_gemm_features(const float *w, const float *x, const float *bias, float *y, int64_t m, int64_t n,
                           int64_t k, int64_t r0, int64_t r1) {
    if (m == 1) {
        gemv_features(w, x, bias, y, k, r0, r1);
        return;
    }
    const int64_t kv = k & ~(int64_t)7;
    const int64_t groups = (m + 2) / 3;
    /* The block to prefetch (4k floats: `lines` cache lines) is split between the row groups, each
     * prefetching its share (`per_group` lines from next + g * per_group * 16) one line a k step, or
     * two (pwide: 16-float steps; pnarrow: 8-float ones) where its share has more lines than its k
     * loop has steps. With one row group only the block's first half: the hardware prefetcher follows
     * the rest, and prefetching all of it measured slower (every product of the model at one row,
     * 2 threads: 24.0 ms against 21.4) */
    const int64_t lines = (4 * k + 15) / 16;
    const int64_t per_group = groups >= 2 ? (lines + groups - 1) / groups : lines / 2;
    const int pwide = per_group > k / 16, pnarrow = per_group > k / 8;
#define PN(g) (lines - (g) * per_group < per_group ? lines - (g) * per_group : per_group) /* g's share */
    for (int64_t r = r0; r < r1;) {
        const int wide = r + 4 <= r1;
        const float *wr = w + r * k, *br = bias ? bias + r : 0;
        const float *next = r + 4 * PF_AHEAD < r1 ? wr + 4 * PF_AHEAD * k : wr;
        int64_t b = 0, g = 0;
/* activation rows b.. b+MR-1 times the 4-row block (or, at the end of the range, one weight row) */
#define ARGS wr, x + b * k, y + b * n + r, k, kv, n, br, next + g * per_group * 16, PN(g), pwide, pnarrow
#define BLOCK(MR)                          \
    do {                                   \
        if (wide) block_4x##MR(ARGS);      \
        else block_1x##MR(ARGS);           \
    } while (0)
        for (; b + 3 <= m; b += 3, g++) BLOCK(3);
        if (m - b == 2) BLOCK(2);
        else if (m - b == 1) BLOCK(1);
#undef BLOCK
#undef ARGS
        r += wide ? 4 : 1;
    }
#undef PN
}

void pdserve_gemm_f32(const float *w, const float *x, const float *bias, float *y, int64_t m, int64_t n,
                      int64_t k, int32_t num_threads) {
    const int64_t per_thread_min = 64; /* output features: below this per thread, fewer threads */
    int threads = num_threads < 1 ? 1 : num_threads;
    if (n / per_thread_min < threads) threads = (int)(n / per_thread_min) > 0 ? (int)(n / per_thread_min) : 1;
    if (threads == 1 || m < 1) {
        if (m >= 1) pdserve_gemm_features(w, x, bias, y, m, n, k, 0, n);
        return;
    }
#pragma omp parallel num_threads(threads)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int64_t chunks = (n + 3) / 4;
        const int64_t c0 = chunks * t / nt, c1 = chunks * (t + 1) / nt;
        pdserve_gemm_features(w, x, bias, y, m, n, k, c0 * 4, c1 * 4 < n ? c1 * 4 : n);
    }
}

/* hidden += delta (when delta is given), then out = rms_norm(hidden) * weight, row by row.
 * As torch: the mean of squares in float32, x * rsqrt(mean + eps), then * weight. */
NO_CONTRACT void pdserve_add_rms_norm_row(float *h, const float *d, const float *wt, float *o, int64_t dim,
                                      float eps) {
    const int64_t dv = dim & ~(int64_t)7;
    v8 acc = {0};
    int64_t i = 0;
    for (; i < dv; i += 8) {
        v8 x = ld(h + i);
        if (d) {
            x = x + ld(d + i);
            st(h + i, x);
        }
        acc = acc + x * x;
    }
    float ss = hsum8(acc);
    for (; i < dim; i++) {
        if (d) h[i] = h[i] + d[i];
        ss += h[i] * h[i];
    }
    const float inv = 1.0f / sqrtf(ss / (float)dim + eps);
    i = 0;
    for (; i < dv; i += 8) st(o + i, (ld(h + i) * inv) * ld(wt + i));
    for (; i < dim; i++) o[i] = (h[i] * inv) * wt[i];
}

void pdserve_add_rms_norm_f32(float *hidden, const float *delta, const float *weight, float *out, int64_t rows,
                              int64_t dim, float eps, int32_t num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows >= 64 && num_threads > 1) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        pdserve_add_rms_norm_row(hidden + r * dim, delta ? delta + r * dim : 0, weight, out + r * dim, dim, eps);
    }
}

/* In place on `heads` heads of each token (token stride `token_stride` floats, heads
 * contiguous): x[i] <- x[i] * cos[i] - x[i + half] * sin[i], x[i + half] <- x[i + half] * cos[i + half]
 * + x[i] * sin[i + half]; cos/sin rows of `head_dim` per token. Bitwise torch's
 * (x * cos) + (rotate_half(x) * sin). */
NO_CONTRACT void pdserve_rope_token(float *x, const float *c, const float *s, int32_t heads, int32_t head_dim) {
    const int half = head_dim / 2;
    for (int h = 0; h < heads; h++) {
        float *p = x + (int64_t)h * head_dim;
        int i = 0;
        for (; i + 8 <= half; i += 8) {
            const v8 a = ld(p + i), b = ld(p + half + i);
            st(p + i, a * ld(c + i) - b * ld(s + i));
            st(p + half + i, b * ld(c + half + i) + a * ld(s + half + i));
        }
        for (; i < half; i++) {
            const float a = p[i], b = p[half + i];
            p[i] = a * c[i] - b * s[i];
            p[half + i] = b * c[half + i] + a * s[half + i];
        }
    }
}

void pdserve_rope_f32(float *x, int64_t token_stride, const float *cos_t, const float *sin_t, int64_t tokens,
                      int32_t heads, int32_t head_dim, int32_t num_threads) {
#pragma omp parallel for num_threads(num_threads) if (tokens >= 64 && num_threads > 1) schedule(static)
    for (int64_t t = 0; t < tokens; t++) {
        pdserve_rope_token(x + t * token_stride, cos_t + t * head_dim, sin_t + t * head_dim, heads, head_dim);
    }
}

/* o[i] = silu(g[i]) * u[i] for i0 <= i < i1, silu(g) = g / (1 + exp(-g)) */
void pdserve_silu_mul_range(const float *g, const float *u, float *o, int64_t i0, int64_t i1) {
    int64_t i = i0;
    for (; i + 8 <= i1; i += 8) {
        const v8 gv = ld(g + i);
        st(o + i, gv / (1.0f + exp8(-gv)) * ld(u + i));
    }
    for (; i < i1; i++) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
}

/* out[r, i] = silu(gate_up[r, i]) * gate_up[r, inter + i] */
void pdserve_silu_mul_f32(const float *gate_up, float *out, int64_t rows, int64_t inter, int32_t num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows >= 16 && num_threads > 1) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gate_up + r * 2 * inter;
        pdserve_silu_mul_range(g, g + inter, out + r * inter, 0, inter);
    }
}

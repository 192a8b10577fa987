/* The decoder's per-layer small ops and the one-row product, float32, on CPU.
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

#include "cpu_simd.h"


#define NO_CONTRACT __attribute__((optimize("fp-contract=off")))

static inline v8 ld(const float *p) { return *(const v8u *)p; }
static inline void st(float *p, v8 x) { *(v8u *)p = x; }

static inline float hsum8(v8 a) {
    return ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7]));
}

/* y[n] = W[n, k] . x[k] (+ bias[n]). W row-major as torch holds it ([out, in]), streamed
 * once: the threads split the output rows in contiguous ranges of 8. */
static inline v8 fma8(v8 a, v8 b, v8 c) { return a * b + c; }

static void gemv_rows(const float *w, const float *x, const float *bias, float *y, int64_t r0, int64_t r1,
                      int64_t k) {
    const int64_t kv = k & ~(int64_t)15;
    int64_t r = r0;
    for (; r + 4 <= r1; r += 4) {
        const float *w0 = w + r * k, *w1 = w0 + k, *w2 = w1 + k, *w3 = w2 + k;
        v8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, b0 = {0}, b1 = {0}, b2 = {0}, b3 = {0};
        for (int64_t i = 0; i < kv; i += 16) {
            const v8 x0 = ld(x + i), x1 = ld(x + i + 8);
            a0 = fma8(ld(w0 + i), x0, a0); b0 = fma8(ld(w0 + i + 8), x1, b0);
            a1 = fma8(ld(w1 + i), x0, a1); b1 = fma8(ld(w1 + i + 8), x1, b1);
            a2 = fma8(ld(w2 + i), x0, a2); b2 = fma8(ld(w2 + i + 8), x1, b2);
            a3 = fma8(ld(w3 + i), x0, a3); b3 = fma8(ld(w3 + i + 8), x1, b3);
        }
        float s0 = hsum8(a0 + b0), s1 = hsum8(a1 + b1), s2 = hsum8(a2 + b2), s3 = hsum8(a3 + b3);
        for (int64_t i = kv; i < k; i++) {
            s0 += w0[i] * x[i]; s1 += w1[i] * x[i]; s2 += w2[i] * x[i]; s3 += w3[i] * x[i];
        }
        if (bias) { s0 += bias[r]; s1 += bias[r + 1]; s2 += bias[r + 2]; s3 += bias[r + 3]; }
        y[r] = s0; y[r + 1] = s1; y[r + 2] = s2; y[r + 3] = s3;
    }
    for (; r < r1; r++) {
        const float *w0 = w + r * k;
        v8 a0 = {0}, b0 = {0};
        for (int64_t i = 0; i < kv; i += 16) {
            a0 = fma8(ld(w0 + i), ld(x + i), a0);
            b0 = fma8(ld(w0 + i + 8), ld(x + i + 8), b0);
        }
        float s = hsum8(a0 + b0);
        for (int64_t i = kv; i < k; i++) s += w0[i] * x[i];
        y[r] = bias ? s + bias[r] : s;
    }
}

void pdserve_gemv_f32(const float *w, const float *x, const float *bias, float *y, int64_t n, int64_t k,
                      int32_t num_threads) {
    const int64_t per_thread_min = 64; /* rows: below this, one thread */
    int threads = num_threads < 1 ? 1 : num_threads;
    if (n / per_thread_min < threads) threads = (int)(n / per_thread_min) > 0 ? (int)(n / per_thread_min) : 1;
    if (threads == 1) {
        gemv_rows(w, x, bias, y, 0, n, k);
        return;
    }
#pragma omp parallel num_threads(threads)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int64_t chunks = (n + 7) / 8;
        const int64_t c0 = chunks * t / nt, c1 = chunks * (t + 1) / nt;
        const int64_t r1 = c1 * 8 < n ? c1 * 8 : n;
        gemv_rows(w, x, bias, y, c0 * 8, r1, k);
    }
}

/* hidden += delta (when delta is given), then out = rms_norm(hidden) * weight, row by row.
 * As torch: the mean of squares in float32, x * rsqrt(mean + eps), then * weight. */
NO_CONTRACT static void add_rms_norm_row(float *h, const float *d, const float *wt, float *o, int64_t dim, float eps) {
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
        add_rms_norm_row(hidden + r * dim, delta ? delta + r * dim : 0, weight, out + r * dim, dim, eps);
    }
}

/* In place on `heads` heads of each token (token stride `token_stride` floats, heads
 * contiguous): x[i] <- x[i] * cos[i] - x[i + half] * sin[i], x[i + half] <- x[i + half] * cos[i + half]
 * + x[i] * sin[i + half]; cos/sin rows of `head_dim` per token. Bitwise torch's
 * (x * cos) + (rotate_half(x) * sin). */
NO_CONTRACT static void rope_token(float *x, const float *c, const float *s, int32_t heads, int32_t head_dim) {
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
        rope_token(x + t * token_stride, cos_t + t * head_dim, sin_t + t * head_dim, heads, head_dim);
    }
}

/* out[r, i] = silu(gate_up[r, i]) * gate_up[r, inter + i], silu(g) = g / (1 + exp(-g)) */
void pdserve_silu_mul_f32(const float *gate_up, float *out, int64_t rows, int64_t inter, int32_t num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows >= 16 && num_threads > 1) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gate_up + r * 2 * inter, *u = g + inter;
        float *o = out + r * inter;
        int64_t i = 0;
        for (; i + 8 <= inter; i += 8) {
            const v8 gv = ld(g + i);
            st(o + i, gv / (1.0f + exp8(-gv)) * ld(u + i));
        }
        for (; i < inter; i++) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}

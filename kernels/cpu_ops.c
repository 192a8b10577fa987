/* The decoder's per-layer small ops, float32, on CPU (the products are cpu_packed.c's).
 *
 * Built into the same library as cpu_attention.c (kernels/cpu_native.py) and called
 * through ctypes; kernels/native_ops.py holds the contract of each function and the
 * torch expression it stands for. Threads come from OpenMP: the library links
 * libgomp.so.1, which the dynamic loader resolves to the copy torch already loaded,
 * so these kernels run on torch's own thread team (no second pool spinning against it).
 *
 * Rope and the norm are compiled without FMA contraction (NO_CONTRACT): rope and the
 * residual add are then bitwise equal to the torch expressions they replace; the norm
 * and SiLU differ from torch by rounding only.
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

/* What cpu_attention.c and cpu_ops.c share: GCC vector types of 8 floats (AVX2 width) and a
 * vector exp. Included by both; kernels/cpu_native.py hashes it with them into the library's name. */
#ifndef PDSERVE_CPU_SIMD_H
#define PDSERVE_CPU_SIMD_H

#include <stdint.h>

typedef float v8 __attribute__((vector_size(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4), may_alias));
typedef int32_t i32x8 __attribute__((vector_size(32)));

/* exp(x), x clamped to [-87.3, 88.3] (below: ~1e-38; NaN, e.g. -inf - -inf in attention's running
 * max, counts as below), Cephes' expf polynomial (about 1 ulp) */
static inline v8 exp8(v8 x) {
    const v8 lo = {-87.3f, -87.3f, -87.3f, -87.3f, -87.3f, -87.3f, -87.3f, -87.3f};
    const v8 hi = {88.3f, 88.3f, 88.3f, 88.3f, 88.3f, 88.3f, 88.3f, 88.3f};
    i32x8 m = x > lo; /* false for NaN */
    x = (v8)(((i32x8)x & m) | ((i32x8)lo & ~m));
    m = x > hi;
    x = (v8)(((i32x8)hi & m) | ((i32x8)x & ~m));
    const v8 n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f; /* 1.5 * 2^23: to nearest */
    const v8 r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
    v8 p = 1.9875691500e-4f * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + r + 1.0f;
    const i32x8 bits = (__builtin_convertvector(n, i32x8) + 127) << 23;
    return p * (v8)bits;
}

#endif

/* What the library's C files share: GCC vector types of 8 floats (AVX2 width) and of the build's widest
 * vectors, a vector exp, and the attention kernels' loads (float32 or bfloat16) and reductions. Included by both; kernels/cpu_native.py hashes it with them into the library's name. */
#ifndef PDSERVE_CPU_SIMD_H
#define PDSERVE_CPU_SIMD_H

#include <stdint.h>

typedef float v8 __attribute__((vector_size(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4), may_alias));
typedef int32_t i32x8 __attribute__((vector_size(32)));

/* exp(x), x clamped to [-87.3, 88.3] (below: ~1e-38; NaN, e.g. -inf - -inf in attention's running
 * max, counts as below), Cephes' expf polynomial (about 1 ulp). Defined for a float vector type VT and its
 * int32 twin IT, so that every width computes the same bits lane for lane. */
#define PDSERVE_DEFINE_EXP(NAME, VT, IT)                                                                    \
    static inline VT NAME(VT x) {                                                                           \
        const VT lo = (VT){0} - 87.3f, hi = (VT){0} + 88.3f;                                                \
        IT m = x > lo; /* false for NaN */                                                                  \
        x = (VT)(((IT)x & m) | ((IT)lo & ~m));                                                              \
        m = x > hi;                                                                                         \
        x = (VT)(((IT)hi & m) | ((IT)x & ~m));                                                              \
        const VT n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f; /* 1.5 * 2^23: to nearest */ \
        const VT r = (x - n * 0.693359375f) - n * -2.12194440e-4f;                                          \
        VT p = 1.9875691500e-4f * r + 1.3981999507e-3f;                                                     \
        p = p * r + 8.3334519073e-3f;                                                                       \
        p = p * r + 4.1665795894e-2f;                                                                       \
        p = p * r + 1.6666665459e-1f;                                                                       \
        p = p * r + 5.0000001201e-1f;                                                                       \
        p = p * (r * r) + r + 1.0f;                                                                         \
        const IT bits = (__builtin_convertvector(n, IT) + 127) << 23;                                       \
        return p * (VT)bits;                                                                                \
    }

PDSERVE_DEFINE_EXP(exp8, v8, i32x8)

typedef uint16_t u16x8 __attribute__((vector_size(16), aligned(2), may_alias));
typedef uint32_t u32x8 __attribute__((vector_size(32)));

static inline v8 load8(const void *p, int bf16) {
    if (bf16) {
        u32x8 w = __builtin_convertvector(*(const u16x8 *)p, u32x8) << 16;
        return (v8)w;
    }
    return *(const v8u *)p;
}

/* The build's widest vectors (the attention kernels'): VW = 16 floats where it has AVX-512 (32 registers),
 * else 8; their int32 and bfloat16 twins, a load of float32 or bfloat16 data, a splat, and exp on them
 * (exp8's bits lane for lane). */
#if defined(__AVX512F__)
#define VW 16
typedef float vw __attribute__((vector_size(64)));
typedef float vwu __attribute__((vector_size(64), aligned(4), may_alias));
typedef int32_t iw __attribute__((vector_size(64)));
typedef uint16_t u16xw __attribute__((vector_size(32), aligned(2), may_alias));
typedef uint32_t u32xw __attribute__((vector_size(64)));
PDSERVE_DEFINE_EXP(expw, vw, iw)
#else
#define VW 8
typedef v8 vw;
typedef v8u vwu;
typedef i32x8 iw;
typedef u16x8 u16xw;
typedef u32x8 u32xw;
#define expw exp8
#endif

static inline vw loadw(const void *p, int bf16) {
    if (bf16) return (vw)(__builtin_convertvector(*(const u16xw *)p, u32xw) << 16);
    return *(const vwu *)p;
}

static inline vw splatw(float x) { return (vw){0} + x; }


static inline float load1(const void *p, int64_t i, int bf16) {
    if (bf16) {
        union { uint32_t u; float f; } c = {.u = (uint32_t)((const uint16_t *)p)[i] << 16};
        return c.f;
    }
    return ((const float *)p)[i];
}

static inline void store1(void *p, int64_t i, float x, int bf16) {
    if (bf16) {
        union { float f; uint32_t u; } c = {.f = x};
        uint32_t u = c.u;
        if ((u & 0x7fffffffu) > 0x7f800000u) {
            ((uint16_t *)p)[i] = (uint16_t)((u >> 16) | 0x40); /* quiet NaN */
        } else {
            ((uint16_t *)p)[i] = (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16); /* round to nearest even */
        }
    } else {
        ((float *)p)[i] = x;
    }
}

static inline v8 vmax8(v8 a, v8 b) {
    const i32x8 a_wins = a > b;
    return (v8)(((i32x8)a & a_wins) | ((i32x8)b & ~a_wins));
}

static inline float hsum(v8 a) {
    return ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7]));
}

/* the sum of the lanes, by halves */
static inline float hsumw(vw a) {
#if VW == 16
    return hsum(__builtin_shufflevector(a, a, 0, 1, 2, 3, 4, 5, 6, 7) +
                __builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15));
#else
    return hsum(a);
#endif
}

#endif

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

/* Transposing reductions (the attention kernels' scores of VW keys at once): */
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

#if VW == 16
/* lane u of the result is the sum of the lanes of a[u]: in-lane unpacks and shuffles first (the cheap ones),
 * then two steps across 128-bit lanes */
static inline vw reducew(const vw a[16]) {
    const iw unp_lo = {0, 16, 1, 17, 4, 20, 5, 21, 8, 24, 9, 25, 12, 28, 13, 29};
    const iw unp_hi = {2, 18, 3, 19, 6, 22, 7, 23, 10, 26, 11, 27, 14, 30, 15, 31};
    const iw shuf_lo = {0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29};
    const iw shuf_hi = {2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31};
    const iw even128 = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
    const iw odd128 = {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31};
    vw x[8], y[4], z[2];
    for (int i = 0; i < 8; i++) {
        x[i] = __builtin_shuffle(a[2 * i], a[2 * i + 1], unp_lo) + __builtin_shuffle(a[2 * i], a[2 * i + 1], unp_hi);
    }
    /* y[k]: in each 128-bit lane c, the sums over that lane's 4 columns of keys 4k..4k+3 */
    for (int k = 0; k < 4; k++) {
        y[k] = __builtin_shuffle(x[2 * k], x[2 * k + 1], shuf_lo) + __builtin_shuffle(x[2 * k], x[2 * k + 1], shuf_hi);
    }
    for (int i = 0; i < 2; i++) {
        z[i] = __builtin_shuffle(y[2 * i], y[2 * i + 1], even128) + __builtin_shuffle(y[2 * i], y[2 * i + 1], odd128);
    }
    return __builtin_shuffle(z[0], z[1], even128) + __builtin_shuffle(z[0], z[1], odd128);
}

#else
static inline vw reducew(const vw a[8]) { return reduce8(a); }
#endif

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

/* What cpu_qint8.c (the int8-activation product, its contract in its header comment) shares with
 * cpu_qint8_pairs.c (its tiles of two panels): the VNNI build switch, the tile sizes and the in-register
 * transpose of a record's codes and its Q4 codes' unpacking. Hashed into the library's name with the sources (kernels/cpu_native.py). */
#ifndef PDSERVE_CPU_QINT8_H
#define PDSERVE_CPU_QINT8_H

#include <stdint.h>
#include <string.h>

#include "cpu_internal.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>
#define HAVE_VNNI 1
#else
#define HAVE_VNNI 0
#endif

#define QK 32
#define PAIR_ROWS 4      /* rows of a tile of two panels (its 16 accumulators and sums fill the registers) */
#define PAIR_MIN_ROWS 32 /* products of at least this many rows take tiles of two panels */

#if HAVE_VNNI
#define RN (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)

/* in each 16-byte lane: byte 4 i + j <- byte 4 j + i (a 4 x 4 transpose) */
static inline __m512i byte_pattern(void) {
    return _mm512_broadcast_i32x4(_mm_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15));
}

/* 4 inputs (or pairs) x 16 features, byte 16 i + f -> byte 4 f + i */
static inline __m512i transpose(__m512i v, __m512i dwords, __m512i bytes) {
    return _mm512_shuffle_epi8(_mm512_permutexvar_epi32(dwords, v), bytes);
}

static inline __m512i dword_pattern(void) {
    return _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
}

/* Q4 codes of a record (`codes`: its code bytes), 64-byte chunk t (inputs 8t..8t+7 of its 32) transposed:
 * the low nibbles (inputs 8t, +2, +4, +6) in *lo, the high ones (8t+1, ...) in *hi, with a Q5 record's
 * fifth bits from its plane, whose masks are in the transposed order (each bit widens to 16) */
static inline __attribute__((always_inline)) void q4_codes(const uint8_t *codes, int t, int fmt, __m512i dwords,
                                                           __m512i bytes, __m512i *lo, __m512i *hi) {
    const __m512i low = _mm512_set1_epi8(15);
    const __m512i v = transpose(_mm512_loadu_si512(codes + 64 * t), dwords, bytes);
    *lo = _mm512_and_si512(v, low);
    *hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
    if (WF_Q5(fmt)) {
        uint64_t even, odd;
        memcpy(&even, codes + 16 * PANEL + 16 * t, 8);
        memcpy(&odd, codes + 16 * PANEL + 16 * t + 8, 8);
        *lo = _mm512_or_si512(*lo, _mm512_maskz_set1_epi8(even, 16));
        *hi = _mm512_or_si512(*hi, _mm512_maskz_set1_epi8(odd, 16));
    }
}

/* rows r0..r0+R-1 (R <= PAIR_ROWS) of `a` against two adjacent panels p0 and p1 (cpu_qint8_pairs.c) */
typedef void (*i8pair_fn)(const uint8_t *, const uint8_t *, const QRows *, int64_t, float *, int64_t, const float *,
                          int64_t);
/* the two-panel tile of `rows` rows for fmt, or NULL where fmt keeps cpu_qint8.c's one-panel tiles */
INTERNAL i8pair_fn pdserve_i8pair_pick(int32_t fmt, int64_t rows);
#endif

#endif

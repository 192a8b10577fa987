/* The int8-activation product's tiles of two panels for prompt rows (cpu_qint8.c has the arithmetic's
 * contract and calls these): a product of PAIR_MIN_ROWS rows or more over Q4 codes (Q4_0, Q4_1, Q5_0,
 * Q5_1, Q4_K, Q5_K) takes tiles of PAIR_ROWS rows x 2 panels, each broadcast activation feeding both
 * panels' dot products, with i8tile's arithmetic per output. A separate function because one template of
 * both tile shapes for every format compiled to a slower two-panel loop (0.88x of the one-panel tiles,
 * where this one runs 1.16x: bench.lab.kernel_ab). */
#include <stdint.h>
#include <string.h>

#include "cpu_qint8.h"

#if HAVE_VNNI
/* rows r0..r0+R-1 (R <= PAIR_ROWS) of `a` against two adjacent panels, p0 and p1, for the formats of Q4
 * codes (Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K): each transposed record feeds the dot products of both
 * panels' features, each activation broadcast twice as many. The same arithmetic per output as i8tile. */
static inline __attribute__((always_inline)) void i8pair(const int fmt, const uint8_t *p0, const uint8_t *p1,
                                                         const QRows *a, int64_t r0, float *y, int64_t ldy,
                                                         const float *bias, int64_t cols, const int R) {
    const int64_t k = a->k, blocks = k / QK, rec = pdserve_qrecord_bytes(fmt);
    const int64_t head = pdserve_qcodes_at(fmt);
    const int k_scales = fmt == WF_Q4_K || fmt == WF_Q5_K;
    const int with_min = fmt == WF_Q4_1 || fmt == WF_Q5_1 || k_scales;
    const __m512i dwords = dword_pattern(), bytes = byte_pattern();
    __m512 acc[PAIR_ROWS][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *rp[2] = {p0 + b * rec, p1 + b * rec};
        __m512i isum[PAIR_ROWS][2];
        for (int r = 0; r < R; r++) isum[r][0] = isum[r][1] = _mm512_setzero_si512();
        for (int t = 0; t < QK / 8; t++) {
            __m512i lo[2], hi[2];
            for (int h = 0; h < 2; h++) q4_codes(rp[h] + head, t, fmt, dwords, bytes, &lo[h], &hi[h]);
            for (int r = 0; r < R; r++) {
                int32_t even, odd;
                memcpy(&even, a->q + (r0 + r) * k + b * QK + 8 * t, 4);
                memcpy(&odd, a->q + (r0 + r) * k + b * QK + 8 * t + 4, 4);
                const __m512i e = _mm512_set1_epi32(even), o = _mm512_set1_epi32(odd);
                for (int h = 0; h < 2; h++) {
                    isum[r][h] = _mm512_dpbusd_epi32(isum[r][h], lo[h], e);
                    isum[r][h] = _mm512_dpbusd_epi32(isum[r][h], hi[h], o);
                }
            }
        }
        for (int h = 0; h < 2; h++) {
            const uint8_t *sp = rp[h];
            const __m512 dw = k_scales ? _mm512_loadu_ps(sp) : _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)sp));
            const __m512 mw = k_scales ? _mm512_loadu_ps(sp + 4 * PANEL)
                              : with_min ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sp + 2 * PANEL)))
                                         : _mm512_setzero_ps();
            for (int r = 0; r < R; r++) {
                const int64_t cell = (r0 + r) * blocks + b;
                const __m512 da = _mm512_set1_ps(a->d[cell]);
                __m512i iv = isum[r][h];
                if (!with_min) iv = _mm512_sub_epi32(iv, _mm512_set1_epi32(a->corr[cell]));
                const __m512 s = _mm512_mul_round_ps(dw, da, RN);
                acc[r][h] = _mm512_fmadd_round_ps(s, _mm512_cvtepi32_ps(iv), acc[r][h], RN);
                if (with_min) acc[r][h] = _mm512_fmadd_round_ps(mw, _mm512_set1_ps(a->ds[cell]), acc[r][h], RN);
            }
        }
    }
    for (int r = 0; r < R; r++) {
        float row[2 * PANEL];
        _mm512_storeu_ps(row, acc[r][0]);
        _mm512_storeu_ps(row + PANEL, acc[r][1]);
        float *yr = y + (r0 + r) * ldy;
        for (int64_t c = 0; c < cols; c++) yr[c] = bias ? row[c] + bias[c] : row[c];
    }
}

#define I8PAIR_FN(F, R)                                                                                        \
    static void i8pair_##F##_##R(const uint8_t *p0, const uint8_t *p1, const QRows *a, int64_t r0, float *y,  \
                                 int64_t ldy, const float *bias, int64_t cols) {                               \
        i8pair(F, p0, p1, a, r0, y, ldy, bias, cols, R);                                                       \
    }
#define I8PAIR_ROWS(F) I8PAIR_FN(F, 1) I8PAIR_FN(F, 2) I8PAIR_FN(F, 3) I8PAIR_FN(F, 4)
#define I8PAIR_TABLE(F) {i8pair_##F##_1, i8pair_##F##_2, i8pair_##F##_3, i8pair_##F##_4}
I8PAIR_ROWS(1) I8PAIR_ROWS(2) I8PAIR_ROWS(5) I8PAIR_ROWS(9) I8PAIR_ROWS(10) I8PAIR_ROWS(11)
/* the formats of Q4 codes take tiles of two panels (NULL: the others take cpu_qint8.c's i8tile) */
static const i8pair_fn I8PAIRS[WF_KINDS][PAIR_ROWS] = {[WF_Q4_0] = I8PAIR_TABLE(1), [WF_Q4_1] = I8PAIR_TABLE(2),
                                                       [WF_Q4_K] = I8PAIR_TABLE(5), [WF_Q5_0] = I8PAIR_TABLE(9),
                                                       [WF_Q5_1] = I8PAIR_TABLE(10), [WF_Q5_K] = I8PAIR_TABLE(11)};

i8pair_fn pdserve_i8pair_pick(int32_t fmt, int64_t rows) {
    if (fmt < 0 || fmt >= WF_KINDS || rows < 1 || rows > PAIR_ROWS) return 0;
    return I8PAIRS[fmt][rows - 1];
}
#endif

/* The int8-activation product over weights kept in their GGUF blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K):
 * llama.cpp's
 * arithmetic with AVX-512 VNNI. y = x . W^T (+ bias), on cpu_qpacked.c's packed records, unchanged.
 *
 * Activations: each row is quantized once per product (per thread: pdserve_quantize_rows) in blocks of
 * QK = 32 inputs, the GGUF blocks' width: amax = max |x|, d_a = amax / 127, qa = round(x * (127 / amax))
 * (to nearest, ties to even; amax 0: d_a = 0 and qa = 0), one float32 scale per block (llama.cpp's q8_0
 * keeps d_a in float16; float32 here), with S = sum qa per block.
 *
 * Integer dot products (vpdpbusd: 4 unsigned x signed byte products summed into an int32, no saturation)
 * of the weight codes, as the unsigned operand, with qa, per output feature and block:
 *   Q4_0  w = d_w (q - 8), q in 0..15:    I = sum q qa - 8 S
 *   Q8_0  w = d_w q, q in -128..127:      I = sum (q + 128) qa - 128 S  (q ^ 0x80 as an unsigned byte)
 *   Q4_1  w = d_w q + m_w:                I = sum q qa   (Q4_K the same, d_w and m_w float32)
 *   Q5_0  w = d_w (q - 16), q in 0..31:   I = sum q qa - 16 S;  Q5_1 as Q4_1, Q5_K as Q4_K (q in 0..31)
 *   Q6_K  w = d_w (q - 32) + m_w, q in 0..63, d_w per 16 inputs: I0 = sum q qa - 32 S0 over inputs 0-15 (S0
 *         their sum of qa), I1 over 16-31 with d_w1 (KMIX the same records; Q6_K's own rows have m_w = 0)
 * Q8_0 takes llama.cpp's offset form, not its sign trick (|q| times qa with q's sign): the offset is one
 * XOR per 64 bytes of codes, shared by every row of the tile, and its correction rides on Q4_0's, while
 * the sign trick costs a masked subtract per row and vector. Every I is exact (|I| < 2^24) and converts to
 * float exactly. Then, in this order, each step one rounding (fused multiply-adds round once), so a torch
 * reference that does the same float32 operations is bitwise equal (tests/unit/test_gguf_int8_activations.py):
 *   acc = fma(d_w * d_a, float(I), acc);  Q4_1, Q5_1, Q4_K, Q5_K: acc = fma(m_w, d_a * float(S), acc)
 *   Q6_K: acc = fma(d_w0 * d_a, float(I0), acc);  acc = fma(d_w1 * d_a, float(I1), acc);
 *         acc = fma(m_w, d_a * float(S), acc)
 * over the blocks in order from acc = 0, then y = acc + bias. The fused form takes 4 vector operations per
 * row, block and 16 features beside Q4_1's 8 vpdpbusd, which share their pipes (separate multiplies and
 * adds took 6: one layer's 1,024-row products took 1.02-1.13x as long, bench.lab.kernel_ab). A value
 * depends on its row and its feature only: bitwise the same for any row count, tile or thread split (a
 * token rounds alike in a prompt chunk and a decode step), but not the float32 mode's value (that one is
 * the dequantized float32 model's).
 *
 * Codes: cpu_qpacked.c's records are feature-minor (16 bytes per input or Q4 pair of inputs, one byte per
 * feature); vpdpbusd wants each int32 lane to hold 4 consecutive codes of one feature. One 64-byte load
 * holds 4 inputs (Q8) or pairs (Q4) x 16 features; a vpermd and an in-lane vpshufb transpose it to
 * [feature][4] (AVX-512 F/BW, so every VNNI CPU; vpermb would do it in one with VBMI). A Q4 byte holds the
 * pair (2j, 2j+1): its low nibbles give inputs 8t, 8t+2, 8t+4, 8t+6 of 64-byte chunk t and its high ones
 * 8t+1, ..+7, so a Q4 row's qa are stored evens-then-odds within each 8 inputs. The weights keep one
 * layout for both modes (the file's bytes, once): the >8-row tiles below and the float32 mode read the
 * same records, and a reload or another kernel unpacks them as before.
 *
 * Rows: a register tile of R <= 8 rows x 1 panel (R int32 block sums and R float accumulators), over the
 * rows in groups of 8 for every panel, so a panel's records stay in L1/L2 while a chunk of rows (MC_BYTES of
 * codes, in L2) passes; a decode step reads each record once, the next panel prefetched meanwhile. A
 * product of PAIR_MIN_ROWS rows or more (prompt chunks) over Q4 codes (Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K)
 * takes tiles of 4 rows x 2 panels instead (cpu_qint8_pairs.c): each broadcast activation feeds both
 * panels' dot products, and one layer's 1,024-row products of the default model ran 1.16x faster
 * (bench.lab.kernel_ab); Q8_0 and Q6_K keep i8tile (a pair tile for their codes is not written yet).
 * Built without AVX512-VNNI: pdserve_i8_available() is 0, and the engine refuses the mode
 * (kernels/native_ops.py).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_qint8.h"

#define GROUP_ROWS TILE_ROWS_MAX
#define MC_BYTES (256 * 1024) /* activation codes per chunk of rows: they stay in L2 while every panel passes */

int32_t pdserve_i8_available(void) { return HAVE_VNNI; }

#if HAVE_VNNI
static __thread uint8_t *qbuf; /* this thread's quantized rows (pdserve_quantize_rows), grown as needed */
static __thread int64_t qbuf_bytes;
static __thread QRows qrows;

/* a Q4 row's qa within each 8 inputs: the evens, then the odds */
static inline __m256i evens_odds(void) {
    return _mm256_broadcastsi128_si256(_mm_setr_epi8(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15));
}
#endif

static inline int64_t offset_of(int32_t fmt) {
    return fmt == WF_Q8_0 ? 128 : fmt == WF_Q4_0 ? 8 : fmt == WF_Q5_0 ? 16 : fmt == WF_Q6_K ? 32 : 0;
}

const QRows *pdserve_quantize_rows(int32_t fmt, const float *x, int64_t m, int64_t k) {
#if HAVE_VNNI
    if (fmt == WF_KMIX) fmt = WF_Q6_K;
    const int64_t blocks = k / QK, cells = m * blocks;
    const int64_t need = (m * k + 63) / 64 * 64 + cells * (int64_t)(2 * sizeof(float) + 2 * sizeof(int32_t));
    if (need > qbuf_bytes) {
        free(qbuf);
        qbuf = (uint8_t *)aligned_alloc(64, (size_t)need);
        qbuf_bytes = qbuf ? need : 0;
        if (!qbuf) return 0;
    }
    QRows *a = &qrows;
    a->q = (int8_t *)qbuf;
    a->d = (float *)(qbuf + (m * k + 63) / 64 * 64);
    a->ds = a->d + cells;
    a->corr = (int32_t *)(a->ds + cells);
    a->lo = a->corr + cells;
    a->m = m;
    a->k = k;
    const int q4 = fmt != WF_Q8_0 && fmt != WF_Q6_K;
    const int32_t offset = (int32_t)offset_of(fmt);
    const __m256i order = evens_odds();
    for (int64_t r = 0; r < m; r++)
        for (int64_t b = 0; b < blocks; b++) {
            const float *xb = x + r * k + b * QK;
            const __m512 x0 = _mm512_loadu_ps(xb), x1 = _mm512_loadu_ps(xb + 16);
            const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
            const float d = amax / 127.0f, id = amax != 0.0f ? 127.0f / amax : 0.0f;
            const __m512i i0 = _mm512_cvt_roundps_epi32(_mm512_mul_round_ps(x0, _mm512_set1_ps(id), RN), RN);
            const __m512i i1 = _mm512_cvt_roundps_epi32(_mm512_mul_round_ps(x1, _mm512_set1_ps(id), RN), RN);
            const int32_t lo = _mm512_reduce_add_epi32(i0), s = lo + _mm512_reduce_add_epi32(i1);
            __m256i bytes = _mm256_set_m128i(_mm512_cvtsepi32_epi8(i1), _mm512_cvtsepi32_epi8(i0));
            if (q4) bytes = _mm256_shuffle_epi8(bytes, order);
            _mm256_storeu_si256((__m256i *)(a->q + r * k + b * QK), bytes);
            a->d[r * blocks + b] = d;
            a->ds[r * blocks + b] = _mm_cvtss_f32(_mm_mul_round_ss(_mm_set_ss(d), _mm_set_ss((float)s), RN));
            a->corr[r * blocks + b] = offset * s;
            a->lo[r * blocks + b] = lo;
        }
    return a;
#else
    (void)fmt, (void)x, (void)m, (void)k;
    return 0;
#endif
}

#if HAVE_VNNI
/* rows r0..r0+R-1 of `a` against one panel; y and bias at the panel's first column, `cols` written */
static inline __attribute__((always_inline)) void i8tile(const int fmt, const uint8_t *p, const QRows *a, int64_t r0,
                                                         float *y, int64_t ldy, const float *bias, int64_t cols,
                                                         const uint8_t *pf, const int R) {
    const int64_t k = a->k, blocks = k / QK, rec = pdserve_qrecord_bytes(fmt);
    const int64_t head = pdserve_qcodes_at(fmt);
    const int k_scales = fmt == WF_Q4_K || fmt == WF_Q5_K || fmt == WF_Q6_K; /* float32 scales, not float16 */
    const __m512i dwords = dword_pattern(), bytes = byte_pattern();
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    __m512 acc[GROUP_ROWS];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *rp = p + b * rec, *codes = rp + head;
        if (pf)
            for (int64_t line = 0; line < rec; line += 64) __builtin_prefetch(pf + b * rec + line, 0, 3);
        __m512i isum[GROUP_ROWS], ilo[GROUP_ROWS];
        for (int r = 0; r < R; r++) isum[r] = ilo[r] = _mm512_setzero_si512();
        if (fmt == WF_Q6_K) { /* inputs 0-15 into ilo, 16-31 into isum */
            for (int g = 0; g < QK / 4; g++) {
                const __m512i w = transpose(_mm512_loadu_si512(codes + 64 * g), dwords, bytes);
                for (int r = 0; r < R; r++) {
                    int32_t qa;
                    memcpy(&qa, a->q + (r0 + r) * k + b * QK + 4 * g, 4);
                    if (g < QK / 8) ilo[r] = _mm512_dpbusd_epi32(ilo[r], w, _mm512_set1_epi32(qa));
                    else isum[r] = _mm512_dpbusd_epi32(isum[r], w, _mm512_set1_epi32(qa));
                }
            }
        } else if (fmt == WF_Q8_0) {
            for (int g = 0; g < QK / 4; g++) {
                const __m512i w = _mm512_xor_si512(transpose(_mm512_loadu_si512(codes + 64 * g), dwords, bytes), flip);
                for (int r = 0; r < R; r++) {
                    int32_t qa;
                    memcpy(&qa, a->q + (r0 + r) * k + b * QK + 4 * g, 4);
                    isum[r] = _mm512_dpbusd_epi32(isum[r], w, _mm512_set1_epi32(qa));
                }
            }
        } else {
            for (int t = 0; t < QK / 8; t++) {
                __m512i lo, hi;
                q4_codes(codes, t, fmt, dwords, bytes, &lo, &hi);
                for (int r = 0; r < R; r++) {
                    int32_t even, odd;
                    memcpy(&even, a->q + (r0 + r) * k + b * QK + 8 * t, 4);
                    memcpy(&odd, a->q + (r0 + r) * k + b * QK + 8 * t + 4, 4);
                    isum[r] = _mm512_dpbusd_epi32(isum[r], lo, _mm512_set1_epi32(even));
                    isum[r] = _mm512_dpbusd_epi32(isum[r], hi, _mm512_set1_epi32(odd));
                }
            }
        }
        const __m512 dw = k_scales ? _mm512_loadu_ps(rp) : _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)rp));
        const __m512 dw2 = fmt == WF_Q6_K ? _mm512_loadu_ps(rp + 4 * PANEL) : dw;
        const __m512 mw = fmt == WF_Q6_K    ? _mm512_loadu_ps(rp + 8 * PANEL)
                          : k_scales        ? _mm512_loadu_ps(rp + 4 * PANEL)
                          : fmt == WF_Q4_1 || fmt == WF_Q5_1 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(rp + 2 * PANEL)))
                                           : _mm512_setzero_ps();
        for (int r = 0; r < R; r++) {
            const int64_t cell = (r0 + r) * blocks + b;
            const __m512 da = _mm512_set1_ps(a->d[cell]);
            __m512i iv = isum[r];
            if (fmt == WF_Q6_K) { /* the second half's offset: 32 (S - S0) */
                iv = _mm512_sub_epi32(iv, _mm512_set1_epi32(a->corr[cell] - 32 * a->lo[cell]));
                const __m512i i0 = _mm512_sub_epi32(ilo[r], _mm512_set1_epi32(32 * a->lo[cell]));
                acc[r] = _mm512_fmadd_round_ps(_mm512_mul_round_ps(dw, da, RN), _mm512_cvtepi32_ps(i0), acc[r], RN);
            } else if (fmt != WF_Q4_1 && fmt != WF_Q5_1 && fmt != WF_Q4_K && fmt != WF_Q5_K) {
                iv = _mm512_sub_epi32(iv, _mm512_set1_epi32(a->corr[cell]));
            }
            acc[r] = _mm512_fmadd_round_ps(_mm512_mul_round_ps(dw2, da, RN), _mm512_cvtepi32_ps(iv), acc[r], RN);
            if (fmt == WF_Q4_1 || fmt == WF_Q5_1 || fmt == WF_Q4_K || fmt == WF_Q5_K || fmt == WF_Q6_K)
                acc[r] = _mm512_fmadd_round_ps(mw, _mm512_set1_ps(a->ds[cell]), acc[r], RN);
        }
    }
    for (int r = 0; r < R; r++) {
        float row[PANEL];
        _mm512_storeu_ps(row, acc[r]);
        float *yr = y + (r0 + r) * ldy;
        for (int64_t c = 0; c < cols; c++) yr[c] = bias ? row[c] + bias[c] : row[c];
    }
}

typedef void (*i8tile_fn)(const uint8_t *, const QRows *, int64_t, float *, int64_t, const float *, int64_t,
                          const uint8_t *);
#define I8TILE_FN(F, R)                                                                                        \
    static void i8tile_##F##_##R(const uint8_t *p, const QRows *a, int64_t r0, float *y, int64_t ldy,          \
                                 const float *bias, int64_t cols, const uint8_t *pf) {                         \
        i8tile(F, p, a, r0, y, ldy, bias, cols, pf, R);                                                        \
    }
#define I8TILE_ROWS(F) I8TILE_FN(F, 1) I8TILE_FN(F, 2) I8TILE_FN(F, 3) I8TILE_FN(F, 4) I8TILE_FN(F, 5) \
    I8TILE_FN(F, 6) I8TILE_FN(F, 7) I8TILE_FN(F, 8)
#define I8TILE_TABLE(F) {i8tile_##F##_1, i8tile_##F##_2, i8tile_##F##_3, i8tile_##F##_4, i8tile_##F##_5, \
    i8tile_##F##_6, i8tile_##F##_7, i8tile_##F##_8}
I8TILE_ROWS(1) I8TILE_ROWS(2) I8TILE_ROWS(3) I8TILE_ROWS(5) I8TILE_ROWS(6) I8TILE_ROWS(9) I8TILE_ROWS(10) I8TILE_ROWS(11)
static const i8tile_fn I8TILES[WF_KINDS][GROUP_ROWS] = {[WF_Q4_0] = I8TILE_TABLE(1), [WF_Q4_1] = I8TILE_TABLE(2),
                                                        [WF_Q8_0] = I8TILE_TABLE(3), [WF_Q4_K] = I8TILE_TABLE(5),
                                                        [WF_Q6_K] = I8TILE_TABLE(6), [WF_KMIX] = I8TILE_TABLE(6),
                                                        [WF_Q5_0] = I8TILE_TABLE(9), [WF_Q5_1] = I8TILE_TABLE(10),
                                                        [WF_Q5_K] = I8TILE_TABLE(11)};
#endif

void pdserve_i8_panels(int32_t fmt, const uint8_t *p, const QRows *a, const float *bias, float *y, int64_t n,
                       int64_t q0, int64_t q1) {
#if HAVE_VNNI
    if (fmt == WF_KMIX) fmt = WF_Q6_K;
    const int64_t panel_bytes = a->k / QK * pdserve_qrecord_bytes(fmt);
    int64_t mc = MC_BYTES / (a->k > 0 ? a->k : 1) / GROUP_ROWS * GROUP_ROWS;
    if (mc < GROUP_ROWS) mc = GROUP_ROWS;
    const int pairs = a->m >= PAIR_MIN_ROWS && pdserve_i8pair_pick(fmt, 1) != 0;
    for (int64_t m0 = 0; m0 < a->m; m0 += mc) {
        const int64_t m1 = m0 + mc < a->m ? m0 + mc : a->m;
        for (int64_t q = q0; q < q1; q++) {
            const int64_t col = q * PANEL, cols = n - col < PANEL ? n - col : PANEL;
            const uint8_t *panel = p + q * panel_bytes, *next = q + 1 < q1 ? panel + panel_bytes : 0;
            if (pairs && q + 1 < q1) { /* this panel and the next, PAIR_ROWS rows at a time */
                const int64_t both = n - col < 2 * PANEL ? n - col : 2 * PANEL;
                for (int64_t r0 = m0; r0 < m1; r0 += PAIR_ROWS) {
                    const int64_t rows = m1 - r0 < PAIR_ROWS ? m1 - r0 : PAIR_ROWS;
                    pdserve_i8pair_pick(fmt, rows)(panel, panel + panel_bytes, a, r0, y + col, n,
                                                   bias ? bias + col : 0, both);
                }
                q++;
                continue;
            }
            for (int64_t r0 = m0; r0 < m1; r0 += GROUP_ROWS) {
                const int64_t rows = m1 - r0 < GROUP_ROWS ? m1 - r0 : GROUP_ROWS;
                I8TILES[fmt][rows - 1](panel, a, r0, y + col, n, bias ? bias + col : 0, cols,
                                           r0 == m0 ? next : 0);
            }
        }
    }
#else
    (void)fmt, (void)p, (void)a, (void)bias, (void)y, (void)n, (void)q0, (void)q1;
#endif
}

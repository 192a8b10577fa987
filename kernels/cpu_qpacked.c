/* The product of a linear layer whose weight stays in its GGUF blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K,
 * Q6_K), or in an fp8 checkpoint's codes: y = x . W^T (+ bias),
 * with W dequantized in registers as it is read, never as a float32 copy in memory. A format with WF_I8 set
 * takes the int8-activation product instead (cpu_qint8.c, llama.cpp's arithmetic), on the same records.
 *
 * The records (panels of PANEL output features, one record per 32 inputs, each kind's layout) are
 * cpu_qrecords.c's, which packs them from the file's rows.
 *
 * Values: a weight is w = d * q (Q8_0), d * (q - 8) (Q4_0), d * (q - 16) (Q5_0), d * q + m (Q4_1, Q5_1, Q4_K,
 * Q5_K), d * (q - 32) + m (Q6_K, KMIX; d the half's scale), in float32, which is exactly what gguf.quants.dequantize gives (each product is
 * exact in float32: d has 11 significant bits and q at most 8, a K scale 11 + 7 and its q at most 5, so the one
 * rounding is the add of m (gguf's d * q - dmin * min, the same value; Q6_K's m = 0 changes no value), the same
 * in an FMA); FP8's w = value(q) * d is one float32 product, rounded as the loader's dequantization rounds it
 * (engine/checkpoint_quant.py); and every output is one FMA chain over the inputs in
 * order (acc = w * x + acc from 0, then + bias), cpu_packed.c's chain. So a product here is bitwise the
 * float32 packed product of the dequantized weight: the model's tokens are those of the dequantized float32
 * model, exactly, and a token rounds alike in a prompt chunk and a decode step.
 *
 * Two paths, one result: up to TILE_ROWS rows (decode steps) a register tile of rows x QTILE_PANELS panels
 * widens each record's codes into weights in registers and uses them for every row (the weight bytes read
 * once, 5-6x fewer than float32's for Q4); more rows (batched decode, prompt chunks) dequantize a group of
 * panels once per chunk of rows into a thread's scratch in cpu_packed.c's float layout and run its tile,
 * which is bound by arithmetic there, not by the weight stream.
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_internal.h"

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#define QK 32 /* inputs per GGUF block */
#define VPP (PANEL / VW)
#if defined(__AVX512F__)
#define QTILE_PANELS 2
#else
#define QTILE_PANELS 1
#endif
#define MC_BYTES (256 * 1024) /* activation rows per chunk, as cpu_packed.c */
#define BYTE_CODES(fmt) ((fmt) == WF_Q8_0 || WF_BYTE_K(fmt) || (fmt) == WF_FP8) /* a code a byte, not Q4's pairs */

/* PANEL float32 values -> VPP vectors */
static inline void load_floats(const uint8_t *p, vw out[VPP]) {
    for (int h = 0; h < VPP; h++) memcpy(&out[h], p + h * VW * 4, sizeof(vw));
}

/* PANEL float16 values -> VPP vectors */
static inline void load_halves(const uint8_t *p, vw out[VPP]) {
#if defined(__AVX512F__)
    out[0] = (vw)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
#elif defined(__AVX2__) && defined(__F16C__)
    for (int h = 0; h < VPP; h++) out[h] = (vw)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 16 * h)));
#else
    for (int h = 0; h < VPP; h++)
        for (int l = 0; l < VW; l++) {
            uint16_t v;
            memcpy(&v, p + 2 * (h * VW + l), 2);
            out[h][l] = pdserve_half_to_float(v);
        }
#endif
}

/* a record's scales: d, m (Q4_1, Q5_1, Q4_K, Q5_K, Q6_K, KMIX) and d2 (Q6_K, KMIX: the second half's d) */
static inline __attribute__((always_inline)) void load_scales(const int fmt, const uint8_t *r, vw d[VPP], vw m[VPP],
                                                              vw d2[VPP]) {
    if (fmt == WF_Q4_K || fmt == WF_Q5_K) {
        load_floats(r, d);
        load_floats(r + 4 * PANEL, m);
        return;
    }
    if (fmt == WF_FP8) {
        load_floats(r, d);
        return;
    }
    if (WF_BYTE_K(fmt)) {
        load_floats(r, d);
        load_floats(r + 4 * PANEL, d2);
        load_floats(r + 8 * PANEL, m);
        return;
    }
    load_halves(r, d);
    if (fmt == WF_Q4_1 || fmt == WF_Q5_1) load_halves(r + 2 * PANEL, m);
}

/* PANEL bytes -> VPP vectors of int32 (unsigned or signed bytes) */
static inline void widen(const uint8_t *p, iw out[VPP], const int is_signed) {
#if defined(__AVX512F__)
    const __m128i b = _mm_loadu_si128((const __m128i *)p);
    out[0] = (iw)(is_signed ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b));
#elif defined(__AVX2__)
    for (int h = 0; h < VPP; h++) {
        const __m128i b = _mm_loadl_epi64((const __m128i *)(p + 8 * h));
        out[h] = (iw)(is_signed ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b));
    }
#else
    for (int h = 0; h < VPP; h++)
        for (int l = 0; l < VW; l++) out[h][l] = is_signed ? (int32_t)(int8_t)p[h * VW + l] : (int32_t)p[h * VW + l];
#endif
}

/* e4m3 codes (in int32 lanes) -> their values: the normal range by moving exponent and mantissa into a float's
 * place and multiplying by the bias difference (exact), subnormals as m * 2^-9, the NaN codes as NaN, the sign
 * set last (so -0 too) */
static inline vw e4m3_values(iw c) {
    const iw mag = c & 0x7f;
    const vw normal = (vw)(mag << 20) * 0x1p120f, sub = __builtin_convertvector(mag & 7, vw) * 0x1p-9f;
    const iw small = (mag >> 3) == 0, nan = mag == 0x7f; /* lanes of -1 or 0 */
    const iw qnan = (iw)((vw){0} + __builtin_nanf(""));
    iw bits = ((iw)normal & ~small) | ((iw)sub & small);
    bits = (bits & ~nan) | (qnan & nan);
    return (vw)(bits | (iw)((u32xw)(c & 0x80) << 24));
}

/* The fifth bits of inputs 2j (lo) and 2j + 1 (hi) of a Q5 record's PANEL features (its plane: the header
 * comment), 16 or 0 per lane */
static inline void fifth_bits(const uint8_t *plane, int j, iw lo[VPP], iw hi[VPP]) {
    const int t = j / 4, i = j % 4;
    uint64_t mlo, mhi;
    memcpy(&mlo, plane + 16 * t, 8);
    memcpy(&mhi, plane + 16 * t + 8, 8);
#if defined(__AVX512F__) && defined(__BMI2__)
    const uint64_t pick = 0x1111111111111111ull << i;
    lo[0] = (iw)_mm512_maskz_set1_epi32((__mmask16)_pext_u64(mlo, pick), 16);
    hi[0] = (iw)_mm512_maskz_set1_epi32((__mmask16)_pext_u64(mhi, pick), 16);
#else
    for (int h = 0; h < VPP; h++)
        for (int l = 0; l < VW; l++) {
            const int f = h * VW + l;
            lo[h][l] = (int32_t)((mlo >> (4 * f + i)) & 1) << 4;
            hi[h][l] = (int32_t)((mhi >> (4 * f + i)) & 1) << 4;
        }
#endif
}

/* The weights of inputs (i, i + 1) (Q4) or i (Q8, Q6_K: `hi` untouched; Q6_K's d the scale of i's half) of one
 * record, VPP vectors each (fmt: a product's format, KMIX as Q6_K). */
static inline __attribute__((always_inline)) void weights_at(const int fmt, const uint8_t *codes, int j,
                                                             const vw *d, const vw *m, vw *lo, vw *hi) {
    iw c[VPP];
    if (fmt == WF_FP8) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
        /* as half precision, which the hardware widens exactly (subnormals too): the code's bits moved to a
         * half's with one arithmetic shift (the sign copied into bit 14, then cleared), its exponent 8 below
         * a half's bias, so the scale times 256 puts it back (one product, the same value) */
        const __m256i w = _mm256_slli_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(codes + j * PANEL))), 8);
        const __m256i half = _mm256_and_si256(_mm256_srai_epi16(w, 1), _mm256_set1_epi16((short)0xBF80));
        lo[0] = (vw)_mm512_cvtph_ps(half) * (d[0] * 256.0f);
#else
        widen(codes + j * PANEL, c, 0);
        for (int h = 0; h < VPP; h++) lo[h] = e4m3_values(c[h]) * d[h];
#endif
        return;
    }
    if (BYTE_CODES(fmt)) {
        widen(codes + j * PANEL, c, fmt == WF_Q8_0);
        for (int h = 0; h < VPP; h++)
            lo[h] = fmt == WF_Q6_K ? __builtin_convertvector(c[h] - 32, vw) * d[h] + m[h]
                                   : __builtin_convertvector(c[h], vw) * d[h];
        return;
    }
    widen(codes + j * PANEL, c, 0);
    iw f5lo[VPP], f5hi[VPP];
    if (WF_Q5(fmt)) fifth_bits(codes + 16 * PANEL, j, f5lo, f5hi);
    for (int h = 0; h < VPP; h++) {
        iw a = c[h] & 15, b = c[h] >> 4;
        if (WF_Q5(fmt)) {
            a |= f5lo[h];
            b |= f5hi[h];
        }
        if (fmt == WF_Q5_0) {
            lo[h] = __builtin_convertvector(a - 16, vw) * d[h];
            hi[h] = __builtin_convertvector(b - 16, vw) * d[h];
        } else if (fmt == WF_Q4_0) {
            lo[h] = __builtin_convertvector(a - 8, vw) * d[h];
            hi[h] = __builtin_convertvector(b - 8, vw) * d[h];
        } else {
            lo[h] = __builtin_convertvector(a, vw) * d[h] + m[h];
            hi[h] = __builtin_convertvector(b, vw) * d[h] + m[h];
        }
    }
}

/* R rows x V panels, weights widened in registers; `pf`: the next panels' records to prefetch (or 0) */
static inline __attribute__((always_inline)) void qtile(const int fmt, const uint8_t *p, int64_t blocks,
                                                        int64_t panel_bytes, const float *x, int64_t ldx, float *y,
                                                        int64_t ldy, const float *bias, int64_t cols,
                                                        const uint8_t *pf, const int R, const int V) {
    const int64_t rec = pdserve_qrecord_bytes(fmt), head = pdserve_qcodes_at(fmt);
    vw acc[TILE_ROWS_MAX][QTILE_PANELS * VPP];
    for (int r = 0; r < R; r++)
        for (int u = 0; u < V * VPP; u++) acc[r][u] = (vw){0};
    for (int64_t b = 0; b < blocks; b++) {
        vw d[QTILE_PANELS * VPP], m[QTILE_PANELS * VPP], d2[QTILE_PANELS * VPP];
        const uint8_t *codes[QTILE_PANELS];
        for (int v = 0; v < V; v++) {
            const uint8_t *r = p + v * panel_bytes + b * rec;
            load_scales(fmt, r, d + v * VPP, m + v * VPP, d2 + v * VPP);
            codes[v] = r + head;
            if (pf)
                for (int64_t line = 0; line < rec; line += 64) __builtin_prefetch(pf + v * panel_bytes + b * rec + line, 0, 3);
        }
        const float *xb = x + b * QK;
        if (BYTE_CODES(fmt)) {
            for (int i = 0; i < QK; i++) {
                vw w[QTILE_PANELS * VPP], unused[VPP];
                const vw *scale = fmt == WF_Q6_K && i >= QK / 2 ? d2 : d;
                for (int v = 0; v < V; v++) weights_at(fmt, codes[v], i, scale + v * VPP, m + v * VPP, w + v * VPP, unused);
                for (int r = 0; r < R; r++) {
                    const vw s = (vw){0} + xb[r * ldx + i];
                    for (int u = 0; u < V * VPP; u++) acc[r][u] = w[u] * s + acc[r][u];
                }
            }
        } else {
            for (int j = 0; j < QK / 2; j++) {
                vw lo[QTILE_PANELS * VPP], hi[QTILE_PANELS * VPP];
                for (int v = 0; v < V; v++) weights_at(fmt, codes[v], j, d + v * VPP, m + v * VPP, lo + v * VPP, hi + v * VPP);
                for (int r = 0; r < R; r++) {
                    const vw s = (vw){0} + xb[r * ldx + 2 * j];
                    for (int u = 0; u < V * VPP; u++) acc[r][u] = lo[u] * s + acc[r][u];
                }
                for (int r = 0; r < R; r++) {
                    const vw s = (vw){0} + xb[r * ldx + 2 * j + 1];
                    for (int u = 0; u < V * VPP; u++) acc[r][u] = hi[u] * s + acc[r][u];
                }
            }
        }
    }
    for (int r = 0; r < R; r++) {
        float row[QTILE_PANELS * PANEL];
        for (int u = 0; u < V * VPP; u++) memcpy(row + u * VW, &acc[r][u], sizeof(vw));
        for (int64_t c = 0; c < cols; c++) y[r * ldy + c] = bias ? row[c] + bias[c] : row[c];
    }
}

typedef void (*qtile_fn)(const uint8_t *, int64_t, int64_t, const float *, int64_t, float *, int64_t, const float *,
                         int64_t, const uint8_t *);
#define QTILE_FN(F, R, V)                                                                                      \
    static void qtile_##F##_##R##_##V(const uint8_t *p, int64_t blocks, int64_t pb, const float *x, int64_t ldx, \
                                      float *y, int64_t ldy, const float *bias, int64_t cols, const uint8_t *pf) { \
        qtile(F, p, blocks, pb, x, ldx, y, ldy, bias, cols, pf, R, V);                                          \
    }
#define QTILE_ROWS(F, V) QTILE_FN(F, 1, V) QTILE_FN(F, 2, V) QTILE_FN(F, 3, V) QTILE_FN(F, 4, V) \
    QTILE_FN(F, 5, V) QTILE_FN(F, 6, V) QTILE_FN(F, 7, V) QTILE_FN(F, 8, V)
#define QTILE_TABLE(F, V) {qtile_##F##_1_##V, qtile_##F##_2_##V, qtile_##F##_3_##V, qtile_##F##_4_##V, \
    qtile_##F##_5_##V, qtile_##F##_6_##V, qtile_##F##_7_##V, qtile_##F##_8_##V}
QTILE_ROWS(1, 1) QTILE_ROWS(2, 1) QTILE_ROWS(3, 1) QTILE_ROWS(5, 1) QTILE_ROWS(6, 1) QTILE_ROWS(8, 1)
QTILE_ROWS(9, 1) QTILE_ROWS(10, 1) QTILE_ROWS(11, 1)
#if QTILE_PANELS == 2
QTILE_ROWS(1, 2) QTILE_ROWS(2, 2) QTILE_ROWS(3, 2) QTILE_ROWS(5, 2) QTILE_ROWS(6, 2) QTILE_ROWS(8, 2)
QTILE_ROWS(9, 2) QTILE_ROWS(10, 2) QTILE_ROWS(11, 2)
#define QTILE_FORMAT(F) {QTILE_TABLE(F, 1), QTILE_TABLE(F, 2)}
#else
#define QTILE_FORMAT(F) {QTILE_TABLE(F, 1)}
#endif
/* by format (WF_BF16's row empty) */
static const qtile_fn QTILES[WF_KINDS][QTILE_PANELS][TILE_ROWS_MAX] = {
    [WF_Q4_0] = QTILE_FORMAT(1), [WF_Q4_1] = QTILE_FORMAT(2), [WF_Q8_0] = QTILE_FORMAT(3),
    [WF_Q4_K] = QTILE_FORMAT(5), [WF_Q6_K] = QTILE_FORMAT(6), [WF_KMIX] = QTILE_FORMAT(6), [WF_FP8] = QTILE_FORMAT(8),
    [WF_Q5_0] = QTILE_FORMAT(9), [WF_Q5_1] = QTILE_FORMAT(10), [WF_Q5_K] = QTILE_FORMAT(11)};

/* panels q0..q0+v-1 dequantized into `out` in cpu_packed.c's float layout ([v][k][PANEL]) */
static void dequantize_panels(int32_t fmt, const uint8_t *p, int64_t k, int64_t q0, int64_t v, float *out) {
    const int64_t blocks = k / QK, rec = pdserve_qrecord_bytes(fmt), head = pdserve_qcodes_at(fmt);
    for (int64_t g = 0; g < v; g++)
        for (int64_t b = 0; b < blocks; b++) {
            const uint8_t *r = p + ((q0 + g) * blocks + b) * rec;
            vw d[VPP], m[VPP] = {0}, d2[VPP], lo[VPP], hi[VPP];
            if (fmt == WF_Q4_K || fmt == WF_Q5_K) load_scales(WF_Q4_K, r, d, m, d2);
            else if (fmt == WF_Q6_K) load_scales(WF_Q6_K, r, d, m, d2);
            else if (fmt == WF_FP8) load_scales(WF_FP8, r, d, m, d2);
            else load_scales(WF_Q4_1, r, d, m, d2); /* Q4_0 and Q8_0 leave m unread */
            float *dst = out + (g * k + b * QK) * PANEL;
            const int steps = BYTE_CODES(fmt) ? QK : QK / 2;
            for (int j = 0; j < steps; j++) {
                if (fmt == WF_Q8_0) weights_at(WF_Q8_0, r + head, j, d, m, lo, hi);
                else if (fmt == WF_FP8) weights_at(WF_FP8, r + head, j, d, m, lo, hi);
                else if (fmt == WF_Q6_K) weights_at(WF_Q6_K, r + head, j, j < QK / 2 ? d : d2, m, lo, hi);
                else if (fmt == WF_Q4_0) weights_at(WF_Q4_0, r + head, j, d, m, lo, hi);
                else if (fmt == WF_Q5_0) weights_at(WF_Q5_0, r + head, j, d, m, lo, hi);
                else if (fmt == WF_Q5_1 || fmt == WF_Q5_K) weights_at(WF_Q5_1, r + head, j, d, m, lo, hi);
                else weights_at(WF_Q4_1, r + head, j, d, m, lo, hi); /* Q4_1 and Q4_K: d q + m */
                const int per = BYTE_CODES(fmt) ? 1 : 2;
                for (int h = 0; h < VPP; h++) {
                    memcpy(dst + (per * j) * PANEL + h * VW, &lo[h], sizeof(vw));
                    if (per == 2) memcpy(dst + (2 * j + 1) * PANEL + h * VW, &hi[h], sizeof(vw));
                }
            }
        }
}

/* the whole weight as cpu_packed.c's float panels (bitwise gguf's dequantization; NativeOps.unpack reads it) */
int32_t pdserve_qdequantize(int32_t fmt, const uint8_t *p, float *out, int64_t n, int64_t k) {
    if (!pdserve_qrecord_bytes(fmt) || k % QK) return -1;
    if (fmt == WF_KMIX) fmt = WF_Q6_K; /* the same records */
    dequantize_panels(fmt, p, k, 0, (n + PANEL - 1) / PANEL, out);
    return 0;
}

static __thread float *scratch;
static __thread int64_t scratch_floats;

static float *thread_scratch(int64_t floats) {
    if (floats > scratch_floats) {
        free(scratch);
        scratch = (float *)aligned_alloc(64, (size_t)((floats * 4 + 63) / 64 * 64));
        scratch_floats = scratch ? floats : 0;
    }
    return scratch;
}

void pdserve_any_panels(int32_t fmt, const void *p, const float *x, const float *bias, float *y, int64_t m, int64_t n,
                        int64_t k, int64_t q0, int64_t q1) {
    if (fmt == WF_F32) {
        pdserve_packed_panels((const float *)p, x, bias, y, m, n, k, q0, q1);
        return;
    }
    if (fmt == WF_BF16) {
        pdserve_bf16_panels((const uint16_t *)p, x, bias, y, m, n, k, q0, q1);
        return;
    }
    const uint8_t *w = (const uint8_t *)p;
    if (WF_KIND(fmt) == WF_KMIX) fmt = (fmt & WF_I8) | WF_Q6_K; /* the same records, the same product */
    if (WF_KIND(fmt) == WF_FP8) fmt = WF_FP8; /* no int8-activation product: the float32 one */
    if (fmt & WF_I8) {
        fmt = WF_KIND(fmt);
        const QRows *a = pdserve_quantize_rows(fmt, x, m, k);
        if (a) {
            pdserve_i8_panels(fmt, w, a, bias, y, n, q0, q1);
            return;
        } /* no memory for the rows: the float32 product */
    }
    const int64_t blocks = k / QK, panel_bytes = blocks * pdserve_qrecord_bytes(fmt);
    if (m <= TILE_ROWS_MAX) {
        for (int64_t q = q0; q < q1; q += QTILE_PANELS) {
            const int64_t v = q1 - q < QTILE_PANELS ? q1 - q : QTILE_PANELS;
            const int64_t col = q * PANEL, cols = n - col < v * PANEL ? n - col : v * PANEL;
            const uint8_t *next = q + QTILE_PANELS < q1 ? w + (q + QTILE_PANELS) * panel_bytes : 0;
            QTILES[fmt][v - 1][m - 1](w + q * panel_bytes, blocks, panel_bytes, x, k, y + col, n,
                                          bias ? bias + col : 0, cols, next);
        }
        return;
    }
    float *buf = thread_scratch(k * PACKED_TILE_PANELS * PANEL);
    int64_t mc = (MC_BYTES / 4 / (k > 0 ? k : 1)) / TILE_ROWS_MAX * TILE_ROWS_MAX;
    if (mc < TILE_ROWS_MAX) mc = TILE_ROWS_MAX;
    for (int64_t m0 = 0; m0 < m; m0 += mc) {
        const int64_t m1 = m0 + mc < m ? m0 + mc : m;
        for (int64_t q = q0; q < q1; q += PACKED_TILE_PANELS) {
            const int64_t v = q1 - q < PACKED_TILE_PANELS ? q1 - q : PACKED_TILE_PANELS;
            const int64_t col = q * PANEL, cols = n - col < v * PANEL ? n - col : v * PANEL;
            if (buf) {
                dequantize_panels(fmt, w, k, q, v, buf);
                pdserve_packed_group(buf, v, k, x + m0 * k, m1 - m0, y + m0 * n + col, n, bias ? bias + col : 0, cols);
            } else { /* no scratch: the register tile, row by row groups (the same values) */
                for (int64_t r = m0; r < m1; r += TILE_ROWS_MAX) {
                    const int64_t rows = m1 - r < TILE_ROWS_MAX ? m1 - r : TILE_ROWS_MAX;
                    pdserve_any_panels(fmt, p, x + r * k, bias, y + r * n, rows, n, k, q, q + v);
                }
            }
        }
    }
}

int32_t pdserve_qpacked_f32(int32_t fmt, const uint8_t *p, const float *x, const float *bias, float *y, int64_t m,
                            int64_t n, int64_t k, int32_t num_threads) {
    if (!pdserve_qrecord_bytes(WF_KIND(fmt)) || k % QK) return -1;
    if ((fmt & WF_I8) && (!pdserve_i8_available() || WF_KIND(fmt) == WF_FP8)) return -2;
    const int64_t panels = (n + PANEL - 1) / PANEL;
    int threads = num_threads < 1 ? 1 : num_threads;
    if (threads > panels) threads = (int)(panels > 0 ? panels : 1);
    if (m < 1) return 0;
    if (threads == 1) {
        pdserve_any_panels(fmt, p, x, bias, y, m, n, k, 0, panels);
        return 0;
    }
#pragma omp parallel num_threads(threads)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        pdserve_any_panels(fmt, p, x, bias, y, m, n, k, panels * t / nt, panels * (t + 1) / nt);
    }
    return 0;
}

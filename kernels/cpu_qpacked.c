/* The product of a linear layer whose weight stays in its GGUF blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K),
 * or in an fp8
 * checkpoint's codes: y = x . W^T (+ bias),
 * with W dequantized in registers as it is read, never as a float32 copy in memory. A format with WF_I8 set
 * takes the int8-activation product instead (cpu_qint8.c, llama.cpp's arithmetic), on the same records.
 *
 * Packed layout (pdserve_qpack): the weight in panels of PANEL output features as cpu_packed.c's, each panel
 * a run of records, one per block of QK = 32 inputs (panel q, block b at (q * blocks + b) * record bytes):
 *   d[PANEL]   float16 scales, feature-minor (the block's d of each feature)
 *   m[PANEL]   float16 minimums (Q4_1 only)
 *   codes      Q4: 16 pairs of inputs (2j, 2j+1), PANEL bytes each, byte f = code(f, 2j) | code(f, 2j+1) << 4;
 *              Q8: 32 inputs, PANEL signed bytes each
 * so a record's codes for one input widen to one vector of PANEL codes, with no shuffles. A record holds the
 * file's bytes rearranged (Q4_0 18 bytes per 32 weights, Q4_1 20, Q8_0 34): the weights take in memory
 * what they take on disk. The last panel's missing features are zero.
 *
 * The K formats' file blocks are super-blocks of 256 inputs with 6- or 8-bit scales under a float16 one
 * (llama.cpp's Q4_K: d, dmin, 8 sub-blocks of 32 with a 6-bit scale and min each, 4-bit codes; Q6_K: d,
 * 16 sub-blocks of 16 with an int8 scale each, 6-bit codes). pdserve_qpack expands each sub-block's scales to
 * the float32 products gguf computes, which float16 cannot hold, so their records carry float32 scales:
 *   Q4_K  d[PANEL] = d * scale, m[PANEL] = -(dmin * min) (float32), then Q4's codes        24 bytes per 32 weights
 *   Q6_K  d[PANEL] = d * scale of inputs 0-15, d2[PANEL] the same of 16-31, m[PANEL] = 0 (float32), then 32
 *         inputs of PANEL unsigned bytes, the 6-bit codes 0..63                                   44 bytes per 32 weights
 * against the file's 18 (Q4_K) and 26.25 (Q6_K): 6 and 11 bits per weight in memory, not float32's 32.
 * Q5_0, Q5_1 and Q5_K take Q4_0's, Q4_1's and Q4_K's records and then a plane of fifth bits, 4 bytes per feature
 * (22, 24 and 28 bytes per 32 weights; the first two the file's), laid out for cpu_qint8.c: for each 8 inputs 8t..8t+7, a 64-bit mask of
 * the even inputs' bits, bit 4f + i the one of input 8t + 2i of feature f, then the odd inputs' (8t + 2i + 1);
 * so a mask widens straight to the bytes of its transposed codes (vpmovm2b), and the float32 path picks a
 * feature's 16 bits of one input out of it (pext).
 * A fused matrix whose parts differ in kind (llama.cpp's Q4_K_M keeps some layers' V in Q6_K) is WF_KMIX: Q6_K's
 * records, a Q4_K row's codes q + 32 in them with its d as both halves' and its m (gguf_blocks.py's KMIX rows,
 * 44 bytes per 32 weights, the packing's input).
 *
 * FP8 is no GGUF type: an fp8 (e4m3) checkpoint's weight, its block, channel or tensor scales spread to one
 * float32 scale per row and 32 inputs (gguf_blocks.py's FP8 rows, 36 bytes per 32 weights): a record holds
 * d[PANEL] (float32), then 32 inputs of PANEL codes, 9 bits per weight against bfloat16's 16. The loader keeps
 * no matrix with a NaN code (AVX-512 widens the codes through half precision, where e4m3's NaN is a number).
 *
 * Values: a weight is w = d * q (Q8_0), d * (q - 8) (Q4_0), d * (q - 16) (Q5_0), d * q + m (Q4_1, Q5_1, Q4_K),
 * d * (q - 32) + m (Q6_K,
 * KMIX; d the half's scale), in float32, which is exactly what gguf.quants.dequantize gives (each product is
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

#define QK_K 256 /* inputs per K super-block */
#define IS_K(fmt) ((fmt) == WF_Q4_K || (fmt) == WF_Q5_K || (fmt) == WF_Q6_K) /* file rows of K super-blocks */
#define BYTE_CODES(fmt) ((fmt) == WF_Q8_0 || WF_BYTE_K(fmt) || (fmt) == WF_FP8) /* a code a byte, not Q4's pairs */

static int64_t file_block_bytes(int32_t fmt) {
    switch (fmt) {
    case WF_Q4_0: return 18;
    case WF_Q4_1: return 20;
    case WF_Q5_0: return 22;
    case WF_Q5_1: return 24;
    case WF_Q8_0: return 34;
    case WF_Q4_K: return 144;
    case WF_Q5_K: return 176;
    case WF_Q6_K: return 210;
    case WF_KMIX: return 12 + QK; /* a row's 32-input sub-block: d, d2, m (float32), 32 codes */
    case WF_FP8: return 4 + QK;   /* a row's 32 inputs: d (float32), 32 codes */
    default: return 0;
    }
}

int64_t pdserve_qrecord_bytes(int32_t fmt) {
    switch (fmt) {
    case WF_Q4_0: return 2 * PANEL + 16 * PANEL;
    case WF_Q4_1: return 4 * PANEL + 16 * PANEL;
    case WF_Q5_0: return 2 * PANEL + 16 * PANEL + 4 * PANEL;
    case WF_Q5_1: return 4 * PANEL + 16 * PANEL + 4 * PANEL;
    case WF_Q8_0: return 2 * PANEL + 32 * PANEL;
    case WF_Q4_K: return 8 * PANEL + 16 * PANEL;
    case WF_Q5_K: return 8 * PANEL + 16 * PANEL + 4 * PANEL;
    case WF_Q6_K: case WF_KMIX: return 12 * PANEL + 32 * PANEL;
    case WF_FP8: return 4 * PANEL + 32 * PANEL;
    default: return 0;
    }
}

static inline uint8_t q4_code(const uint8_t *qs, int e) { return e < 16 ? qs[e] & 15 : qs[e - 16] >> 4; }

/* IEEE half to float, exactly (the scalar path and the unpacking) */
static inline float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h >> 15) << 31, exp = (h >> 10) & 31, man = h & 1023;
    union { uint32_t u; float f; } c;
    if (exp == 31) {
        c.u = sign | 0x7f800000u | man << 13;
    } else if (exp) {
        c.u = sign | (exp + 112) << 23 | man << 13;
    } else {
        c.f = (float)man * 5.9604644775390625e-8f; /* 2^-24: subnormal halves are exact in float */
        c.u |= sign;
    }
    return c.f;
}

static inline float half_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return half_to_float(h);
}

/* element e's fifth bit of feature f, set in a Q5 record's plane (the header comment's layout) */
static inline void set_fifth(uint8_t *plane, int f, int e) {
    const int t = e / 8, odd = e % 2, bit = 4 * f + (e % 8) / 2;
    plane[16 * t + 8 * odd + bit / 8] |= (uint8_t)(1u << (bit % 8));
}

/* Sub-block j (32 inputs) of a K super-block `src` as feature f of record r: its two float32 scales and its
 * codes (gguf.quants' Q4_K.get_scale_min, Q5_K's fifth bits, Q6_K's bit layout) */
static void k_record(int32_t fmt, const uint8_t *src, int j, uint8_t *r, int f) {
    float s0, s1;
    uint8_t codes[QK];
    if (fmt == WF_Q4_K || fmt == WF_Q5_K) {
        const uint8_t *sc = src + 4, *qs = src + (fmt == WF_Q5_K ? 48 : 16);
        int scale, min;
        if (j < 4) {
            scale = sc[j] & 63;
            min = sc[j + 4] & 63;
        } else {
            scale = (sc[j + 4] & 15) | (sc[j - 4] >> 6) << 4;
            min = (sc[j + 4] >> 4) | (sc[j] >> 6) << 4;
        }
        s0 = half_at(src) * (float)scale;
        s1 = -(half_at(src + 2) * (float)min);
        for (int e = 0; e < QK; e++) codes[e] = (uint8_t)(qs[32 * (j / 2) + e] >> (4 * (j % 2)) & 15);
        if (fmt == WF_Q5_K)
            for (int e = 0; e < QK; e++)
                if (src[16 + e] >> j & 1) set_fifth(r + pdserve_qcodes_at(fmt) + 16 * PANEL, f, e);
    } else { /* Q6_K: ql[128], qh[64], int8 scales[16], d */
        const uint8_t *ql = src, *qh = src + 128;
        const int8_t *sc = (const int8_t *)(src + 192);
        const float d = half_at(src + 208);
        const int h = j / 4, t = j % 4;
        s0 = d * (float)sc[2 * j];
        s1 = d * (float)sc[2 * j + 1];
        for (int i = 0; i < QK; i++) {
            const int p = 32 * t + i;
            codes[i] = (uint8_t)((ql[64 * h + p % 64] >> (4 * (p / 64)) & 15) | (qh[32 * h + i] >> (2 * t) & 3) << 4);
        }
    }
    memcpy(r + 4 * f, &s0, 4);
    memcpy(r + 4 * PANEL + 4 * f, &s1, 4); /* Q6_K: the second half's d, m (zero) left as memset */
    uint8_t *out = r + pdserve_qcodes_at(fmt);
    if (fmt == WF_Q6_K) {
        for (int i = 0; i < QK; i++) out[i * PANEL + f] = codes[i];
    } else {
        for (int i = 0; i < QK / 2; i++) out[i * PANEL + f] = (uint8_t)(codes[2 * i] | codes[2 * i + 1] << 4);
    }
}

/* raw: n rows of k / QK GGUF blocks each; packed: pdserve_qrecord_bytes(fmt) * ceil(n / PANEL) * k / QK bytes */
int32_t pdserve_qpack(int32_t fmt, const uint8_t *raw, uint8_t *packed, int64_t n, int64_t k) {
    const int64_t rec = pdserve_qrecord_bytes(fmt), fb = file_block_bytes(fmt), per = IS_K(fmt) ? QK_K : QK;
    if (!rec || k % per) return -1;
    const int64_t blocks = k / QK, panels = (n + PANEL - 1) / PANEL, row_bytes = k / per * fb;
    memset(packed, 0, (size_t)(panels * blocks * rec));
    for (int64_t q = 0; q < panels; q++)
        for (int64_t b = 0; b < blocks; b++) {
            uint8_t *r = packed + (q * blocks + b) * rec;
            const int64_t head = pdserve_qcodes_at(fmt);
            for (int f = 0; f < PANEL && q * PANEL + f < n; f++) {
                if (IS_K(fmt)) {
                    k_record(fmt, raw + (q * PANEL + f) * row_bytes + b / 8 * fb, (int)(b % 8), r, f);
                    continue;
                }
                if (fmt == WF_KMIX || fmt == WF_FP8) { /* float32 scales, then 32 codes */
                    const uint8_t *src = raw + (q * PANEL + f) * row_bytes + b * fb;
                    const int scales = fmt == WF_KMIX ? 3 : 1;
                    for (int s = 0; s < scales; s++) memcpy(r + s * 4 * PANEL + 4 * f, src + 4 * s, 4);
                    for (int i = 0; i < QK; i++) r[head + i * PANEL + f] = src[4 * scales + i];
                    continue;
                }
                const uint8_t *src = raw + (q * PANEL + f) * row_bytes + b * fb;
                memcpy(r + 2 * f, src, 2);
                const int with_m = fmt == WF_Q4_1 || fmt == WF_Q5_1;
                if (with_m) memcpy(r + 2 * PANEL + 2 * f, src + 2, 2);
                const uint8_t *qs = src + (with_m ? 4 : 2) + (WF_Q5(fmt) ? 4 : 0);
                if (WF_Q5(fmt)) { /* the fifth bits (a little-endian word, bit e of element e) into the plane */
                    const uint8_t *qh = src + (with_m ? 4 : 2);
                    for (int e = 0; e < QK; e++)
                        if (qh[e / 8] >> (e % 8) & 1) set_fifth(r + head + 16 * PANEL, f, e);
                }
                if (fmt == WF_Q8_0) {
                    for (int i = 0; i < QK; i++) r[head + i * PANEL + f] = qs[i];
                } else {
                    for (int j = 0; j < QK / 2; j++)
                        r[head + j * PANEL + f] = (uint8_t)(q4_code(qs, 2 * j) | q4_code(qs, 2 * j + 1) << 4);
                }
            }
        }
    return 0;
}

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
            out[h][l] = half_to_float(v);
        }
#endif
}

/* a record's scales: d, m (Q4_1, Q4_K, Q6_K, KMIX) and d2 (Q6_K, KMIX: the second half's d) */
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

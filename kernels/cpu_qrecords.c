/* A matrix kept in its GGUF blocks, packed from the file's rows into the records cpu_qpacked.c (the float32-
 * activation product) and cpu_qint8.c (the int8 one) read: pdserve_qpack, once per matrix at load.
 *
 * The layout: the weight in panels of PANEL output features as cpu_packed.c's, each panel
 * a run of records, one per block of QK = 32 inputs (panel q, block b at (q * blocks + b) * record bytes):
 *   d[PANEL]   float16 scales, feature-minor (the block's d of each feature)
 *   m[PANEL]   float16 minimums (Q4_1, Q5_1 only)
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
 * Q5_0, Q5_1 and Q5_K take Q4_0's, Q4_1's and Q4_K's records and then a plane of fifth bits, 4 bytes per
 * feature (22, 24 and 28 bytes per 32 weights; the first two the file's), laid out for cpu_qint8.c: for each 8
 * inputs 8t..8t+7, a 64-bit mask of the even inputs' bits (bit 4f + i the one of input 8t + 2i of feature f),
 * then the odd inputs' (8t + 2i + 1); so a mask widens straight to the bytes of its transposed codes, and the
 * float32 path picks a feature's 16 bits of one input out of it (pext).
 * A fused matrix whose parts differ in kind (llama.cpp's Q4_K_M keeps some layers' V in Q6_K) is WF_KMIX: Q6_K's
 * records, a Q4_K row's codes q + 32 in them with its d as both halves' and its m (gguf_blocks.py's KMIX rows,
 * 44 bytes per 32 weights, the packing's input).
 *
 * FP8 is no GGUF type: an fp8 (e4m3) checkpoint's weight, its block, channel or tensor scales spread to one
 * float32 scale per row and 32 inputs (gguf_blocks.py's FP8 rows, 36 bytes per 32 weights): a record holds
 * d[PANEL] (float32), then 32 inputs of PANEL codes, 9 bits per weight against bfloat16's 16. The loader keeps
 * no matrix with a NaN code (AVX-512 widens the codes through half precision, where e4m3's NaN is a number).
 */
#include <stdint.h>
#include <string.h>

#include "cpu_internal.h"

#define QK 32 /* inputs per GGUF block */
#define QK_K 256 /* inputs per K super-block */
#define IS_K(fmt) ((fmt) == WF_Q4_K || (fmt) == WF_Q5_K || (fmt) == WF_Q6_K) /* file rows of K super-blocks */

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

static inline float half_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return pdserve_half_to_float(h);
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


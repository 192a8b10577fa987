/* The greedy head's screen (kernels/greedy_head.py holds the contract and the error bound it relies on).
 *
 * pdserve_screen_f16: Y[m, n] = X[m, k] . Q[n, k]^T with Q an IEEE half-precision copy of the LM head's
 * [out, in] weight, multiplied in float32: half the bytes of the float32 product's weight stream. The
 * threads split the output features in contiguous ranges of 4; each block of 4 weight rows is converted
 * to float32 once (into an L1 buffer, while the block PF_BLOCKS blocks further on is prefetched into L2,
 * as the float32 few-row product in cpu_ops.c does) and multiplied by the activation rows 3 at a time,
 * 16 floats a k step. Converting once per block rather than per group of 3 rows: at 9 and 16 rows the
 * conversions otherwise took as many cycles as the FMAs. Any summation order: the bound allows for
 * every one.
 *
 * pdserve_screen_candidates: for each activation row b, L_b = max_r (Y[b, r] - |x_b| c[r]); a feature r
 * is a candidate when Y[b, r] + |x_b| c[r] >= L_b for some row b. Written in ascending order; returns
 * their number, -1 when a value is not finite (NaN or infinity: the caller takes the full product) and
 * -2 when there are more than `cap`.
 */

#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "cpu_internal.h"

typedef _Float16 h16 __attribute__((vector_size(32), aligned(2), may_alias));
typedef float f16v __attribute__((vector_size(64)));
typedef float f16vu __attribute__((vector_size(64), aligned(4), may_alias));
typedef int32_t i16v __attribute__((vector_size(64)));

#define PF_BLOCKS 2
#define PREFETCH_LINE(p) __builtin_prefetch((p), 0, 2) /* prefetcht1: into L2 */
#if defined(__AVX512F__) /* keep loaded vectors in registers (GCC otherwise re-reads them per FMA) */
#define PINV(v) __asm__("" : "+v"(v))
#else
#define PINV(v) (void)0
#endif

/* 16 halves to floats: one vcvtph2ps with AVX-512, two with F16C (GCC's generic conversion converts
 * them one at a time on x86), the generic conversion elsewhere (aarch64: fcvtl) */
#if defined(__AVX512F__)
#include <immintrin.h>
static inline f16v ldh(const _Float16 *p) { return (f16v)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
#elif defined(__F16C__)
#include <immintrin.h>
static inline f16v ldh(const _Float16 *p) {
    const __m256 lo = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
    const __m256 hi = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 8)));
    return (f16v){lo[0], lo[1], lo[2], lo[3], lo[4], lo[5], lo[6], lo[7],
                  hi[0], hi[1], hi[2], hi[3], hi[4], hi[5], hi[6], hi[7]};
}
#else
static inline f16v ldh(const _Float16 *p) { return __builtin_convertvector(*(const h16 *)p, f16v); }
#endif
static inline f16v ldf(const float *p) { return *(const f16vu *)p; }

/* lanes u and u + 4 of the result add up to the lanes of the u-th argument's sum (the 16 lanes folded
 * to 8 first) */
typedef float f8v __attribute__((vector_size(32)));
typedef int32_t i8v __attribute__((vector_size(32)));
static inline f8v fold(f16v a) {
    return __builtin_shufflevector(a, a, 0, 1, 2, 3, 4, 5, 6, 7) +
           __builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15);
}
static inline f8v hadd(f8v a, f8v b) {
    const i8v even = {0, 2, 8, 10, 4, 6, 12, 14}, odd = {1, 3, 9, 11, 5, 7, 13, 15};
    return __builtin_shuffle(a, b, even) + __builtin_shuffle(a, b, odd);
}

/* WR weight rows (4, or 1 at the end of a range) times MR activation rows: `w` holds the rows as halves
 * (ldh) or converted to floats (ldf), WT their type */
#define SCREEN_BLOCK(NAME, WT, LOAD, WR, MR)                                                             \
    static inline void NAME##_##WR##x##MR(const WT *w, const float *x, float *y, int64_t k, int64_t ldy) { \
        f16v acc[WR][MR];                                                                                \
        for (int a = 0; a < WR; a++)                                                                     \
            for (int b = 0; b < MR; b++) acc[a][b] = (f16v){0};                                          \
        int64_t i = 0;                                                                                   \
        for (; i + 16 <= k; i += 16) {                                                                   \
            f16v xv[MR];                                                                                 \
            for (int b = 0; b < MR; b++) {                                                               \
                xv[b] = ldf(x + b * k + i);                                                              \
                PINV(xv[b]);                                                                             \
            }                                                                                            \
            for (int a = 0; a < WR; a++) {                                                               \
                f16v q = LOAD(w + a * k + i);                                                            \
                PINV(q);                                                                                 \
                for (int b = 0; b < MR; b++) acc[a][b] = q * xv[b] + acc[a][b];                          \
            }                                                                                            \
        }                                                                                                \
        for (int b = 0; b < MR; b++) {                                                                   \
            float sums[WR];                                                                              \
            if (WR == 4) {                                                                               \
                const f8v t = hadd(hadd(fold(acc[0][b]), fold(acc[1 % WR][b])),                         \
                                   hadd(fold(acc[2 % WR][b]), fold(acc[3 % WR][b])));                    \
                for (int a = 0; a < WR; a++) sums[a] = t[a] + t[a + 4];                                  \
            } else {                                                                                     \
                const f8v t = fold(acc[0][b]);                                                           \
                sums[0] = ((t[0] + t[4]) + (t[1] + t[5])) + ((t[2] + t[6]) + (t[3] + t[7]));             \
            }                                                                                            \
            for (int a = 0; a < WR; a++) {                                                               \
                float s = sums[a];                                                                       \
                for (int64_t j = i; j < k; j++) s += (float)w[a * k + j] * x[b * k + j];                 \
                y[b * ldy + a] = s;                                                                      \
            }                                                                                            \
        }                                                                                                \
    }
#define SCREEN_BLOCKS(NAME, WT, LOAD) \
    SCREEN_BLOCK(NAME, WT, LOAD, 4, 1) \
    SCREEN_BLOCK(NAME, WT, LOAD, 4, 2) \
    SCREEN_BLOCK(NAME, WT, LOAD, 4, 3) \
    SCREEN_BLOCK(NAME, WT, LOAD, 1, 1) \
    SCREEN_BLOCK(NAME, WT, LOAD, 1, 2) \
    SCREEN_BLOCK(NAME, WT, LOAD, 1, 3)
SCREEN_BLOCKS(hblock, _Float16, ldh) /* from the halves: one group of rows */
SCREEN_BLOCKS(fblock, float, ldf)    /* from the converted block: several */

/* rows*k halves from q into floats at w, prefetching pn cache lines from pf into L2 on the way */
static inline void convert_rows(const _Float16 *q, float *w, int64_t n, const char *pf, int64_t pn) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        if (pn > 0) {
            PREFETCH_LINE(pf);
            pf += 64;
            pn--;
        }
        *(f16vu *)(w + i) = ldh(q + i);
    }
    for (; i < n; i++) w[i] = (float)q[i];
}

/* Output features r0..r1 of every row, 4 half rows a block (then single rows at the end of the range),
 * prefetching the block PF_BLOCKS further on into L2. Up to 3 rows (one group) multiply the halves as
 * they are read; more convert each block once into `buf` and multiply every group from there */
static void screen_features(const _Float16 *q, const float *x, float *y, float *buf, int64_t m, int64_t n,
                            int64_t k, int64_t r0, int64_t r1) {
    const int64_t lines = (4 * k * 2 + 63) / 64;
    for (int64_t r = r0; r < r1;) {
        const int wide = r + 4 <= r1;
        const _Float16 *qr = q + r * k;
        const char *pf = (const char *)(qr + 4 * PF_BLOCKS * k);
        const int64_t pn = r + 4 * (PF_BLOCKS + 1) <= r1 ? lines : 0;
        if (m <= 3) {
            for (int64_t l = 0; l < pn; l++) PREFETCH_LINE(pf + 64 * l);
#define HBLOCK(MR)                                          \
    do {                                                    \
        if (wide) hblock_4x##MR(qr, x, y + r, k, n);        \
        else hblock_1x##MR(qr, x, y + r, k, n);             \
    } while (0)
            if (m == 3) HBLOCK(3);
            else if (m == 2) HBLOCK(2);
            else HBLOCK(1);
#undef HBLOCK
        } else {
            convert_rows(qr, buf, (wide ? 4 : 1) * k, pf, pn);
            int64_t b = 0;
#define FBLOCK(MR)                                                    \
    do {                                                              \
        if (wide) fblock_4x##MR(buf, x + b * k, y + b * n + r, k, n); \
        else fblock_1x##MR(buf, x + b * k, y + b * n + r, k, n);      \
    } while (0)
            for (; b + 3 <= m; b += 3) FBLOCK(3);
            if (m - b == 2) FBLOCK(2);
            else if (m - b == 1) FBLOCK(1);
#undef FBLOCK
        }
        r += wide ? 4 : 1;
    }
}

static void screen_range(const _Float16 *q, const float *x, float *y, int64_t m, int64_t n, int64_t k,
                         int64_t r0, int64_t r1) {
    float *buf = aligned_alloc(64, (size_t)((4 * k * sizeof(float) + 63) / 64 * 64));
    if (!buf) { /* no memory for 4 rows: every output NaN, which the candidates step refuses */
        for (int64_t b = 0; b < m; b++)
            for (int64_t r = r0; r < r1; r++) y[b * n + r] = NAN;
        return;
    }
    screen_features(q, x, y, buf, m, n, k, r0, r1);
    free(buf);
}

void pdserve_screen_f16(const void *q, const float *x, float *y, int64_t m, int64_t n, int64_t k,
                        int32_t num_threads) {
    int threads = num_threads < 1 ? 1 : num_threads;
    if (n / 64 < threads) threads = n / 64 > 0 ? (int)(n / 64) : 1;
    if (m < 1) return;
    if (threads == 1) {
        screen_range((const _Float16 *)q, x, y, m, n, k, 0, n);
        return;
    }
#pragma omp parallel num_threads(threads)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int64_t chunks = (n + 3) / 4;
        const int64_t c0 = chunks * t / nt, c1 = chunks * (t + 1) / nt;
        screen_range((const _Float16 *)q, x, y, m, n, k, c0 * 4, c1 * 4 < n ? c1 * 4 : n);
    }
}

int64_t pdserve_screen_candidates(const float *y, const float *c, const float *x, int64_t m, int64_t n,
                                  int64_t k, int64_t *cand, int64_t cap) {
    float *nx = malloc(sizeof(float) * (size_t)m), *low = malloc(sizeof(float) * (size_t)m);
    uint8_t *hit = calloc((size_t)n, 1);
    int64_t count = -1;
    if (!nx || !low || !hit) goto done;
    for (int64_t b = 0; b < m; b++) {
        double ss = 0.0;
        for (int64_t i = 0; i < k; i++) ss += (double)x[b * k + i] * x[b * k + i];
        const double norm = sqrt(ss) * (1.0 + 1e-6);
        if (!isfinite(norm) || norm > 1e30 || norm < 1e-10) goto done; /* the bound needs no underflow */
        nx[b] = (float)norm;
    }
    const int64_t nv = n & ~(int64_t)15;
    for (int64_t b = 0; b < m; b++) {
        const float *yb = y + b * n;
        const f16v s = (f16v){0} + nx[b];
        f16v best = (f16v){0} - INFINITY, bad = (f16v){0};
        int64_t r = 0;
        for (; r < nv; r += 16) {
            const f16v v = ldf(yb + r);
            const f16v lo = v - s * ldf(c + r);
            bad = bad + (v - v); /* NaN for an infinite or NaN value */
            best = (f16v)(((i16v)lo & (lo > best)) | ((i16v)best & ~(lo > best)));
        }
        float L = -INFINITY, sanity = 0.0f;
        for (int i = 0; i < 16; i++) {
            L = best[i] > L ? best[i] : L;
            sanity += bad[i];
        }
        for (; r < n; r++) {
            sanity += yb[r] - yb[r];
            const float lo = yb[r] - nx[b] * c[r];
            L = lo > L ? lo : L;
        }
        if (sanity != 0.0f || !isfinite(L)) goto done;
        low[b] = L;
    }
    for (int64_t b = 0; b < m; b++) {
        const float *yb = y + b * n;
        const f16v s = (f16v){0} + nx[b], lv = (f16v){0} + low[b];
        int64_t r = 0;
        for (; r < nv; r += 16) {
            const i16v up = ldf(yb + r) + s * ldf(c + r) >= lv;
            for (int i = 0; i < 16; i++) hit[r + i] |= (uint8_t)(up[i] & 1);
        }
        for (; r < n; r++) hit[r] |= yb[r] + nx[b] * c[r] >= low[b];
    }
    count = 0;
    for (int64_t r = 0; r < n; r++) {
        if (!hit[r]) continue;
        if (count == cap) {
            count = -2;
            goto done;
        }
        cand[count++] = r;
    }
done:
    free(nx);
    free(low);
    free(hit);
    return count;
}

/* The bfloat16 product of every linear layer under --dtype bfloat16 on CPU: y[m, n] = x[m, k] . W[n, k]^T
 * (+ bias[n]), weights stored in bfloat16, activations rounded to bfloat16 at the product's input, products
 * summed in float32 (AVX512-BF16's vdpbf16ps; the same arithmetic in plain FMAs on CPUs without it).
 *
 * Packed layout (pdserve_pack_bf16): panel q holds features q*PANEL .. q*PANEL+PANEL-1 as [k / 2][PANEL][2]
 * (the pair of inputs 2i, 2i+1 of one feature side by side, as vdpbf16ps reads them), panels one after
 * another, the last one zero-padded: ceil(n / PANEL) * k * PANEL bfloat16 values, half cpu_packed.c's
 * bytes. k must be even. Rounding to bfloat16 (weights when packed, activations per call) is to nearest,
 * ties to even (torch's Tensor.bfloat16()).
 *
 * Arithmetic: each output is one chain over the input pairs in order, from acc = 0:
 *   acc = acc + x[2i+1] * w[2i+1];  acc = acc + x[2i] * w[2i]   (each + rounded to float32)
 * then y = acc + bias. A product of two bfloat16 values is exact in float32, so each step is one rounding
 * (vdpbf16ps's order; FMAs of the widened values give the same bits), and a value depends on its row of x
 * and its feature only: bitwise the same in a prompt chunk and a decode step, on any thread count, in the
 * per-op call and the one-call decoder (cpu_decoder.c, format WF_BF16). vdpbf16ps treats bfloat16
 * subnormals as zero and flushes subnormal sums, which weights and activations of a trained model do not
 * reach; a torch reference that does the same float32 operations in the same order is bitwise equal
 * (tests/unit/test_bf16_products.py).
 *
 * Tiles: R <= 8 rows x V <= 3 panels of float32 accumulators (24 zmm), per input pair V vector loads of 32
 * bfloat16 weights, R broadcasts of a row's pair and R*V vdpbf16ps: twice the multiply-adds of
 * cpu_packed.c's float32 FMA per instruction, on half the weight bytes. The rows are converted to
 * bfloat16 in chunks of MC_BYTES (this thread's buffer, kept in L2 while every panel passes it); while a
 * chunk's first tile of a panel group runs, the next group's panels are prefetched.
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_internal.h"

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define HAVE_DPBF16 1
#else
#define HAVE_DPBF16 0
#endif

#define TILE_ROWS TILE_ROWS_MAX
#define TILE_PANELS 3
#define PAIRS_PER_PANEL (PANEL * 2) /* bfloat16 values per panel and input pair */
#define MC_BYTES (256 * 1024)       /* bfloat16 activations per chunk of rows */

int32_t pdserve_bf16_native(void) { return HAVE_DPBF16; }

static inline uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* NaN stays a quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float from_bf16(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

void pdserve_pack_bf16(const float *w, uint16_t *p, int64_t n, int64_t k) {
    const int64_t panels = (n + PANEL - 1) / PANEL;
    for (int64_t q = 0; q < panels; q++) {
        uint16_t *dst = p + q * k * PANEL;
        for (int j = 0; j < PANEL; j++) {
            const int64_t f = q * PANEL + j;
            for (int64_t i = 0; i < k; i++) dst[(i / 2) * PAIRS_PER_PANEL + 2 * j + (i & 1)] = f < n ? to_bf16(w[f * k + i]) : 0;
        }
    }
}

void pdserve_unpack_bf16(const uint16_t *p, float *w, int64_t n, int64_t k) {
    for (int64_t f = 0; f < n; f++) {
        const uint16_t *src = p + (f / PANEL) * k * PANEL;
        const int j = (int)(f % PANEL);
        for (int64_t i = 0; i < k; i++) w[f * k + i] = from_bf16(src[(i / 2) * PAIRS_PER_PANEL + 2 * j + (i & 1)]);
    }
}

void pdserve_round_bf16(const float *x, uint16_t *out, int64_t count) {
    for (int64_t i = 0; i < count; i++) out[i] = to_bf16(x[i]);
}

/* R rows (xb: bfloat16, row stride ldx values, k even) x V panels; `cols` valid output columns */
static inline __attribute__((always_inline)) void tile(const uint16_t *p, int64_t k, const uint16_t *xb, int64_t ldx,
                                                       float *y, int64_t ldy, const float *bias, int64_t cols,
                                                       const uint16_t *pf, const int R, const int V) {
    const int64_t pairs = k / 2;
#if HAVE_DPBF16
    __m512 acc[TILE_ROWS][TILE_PANELS];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
#pragma GCC unroll 3
        for (int v = 0; v < V; v++) acc[r][v] = _mm512_setzero_ps();
    for (int64_t i = 0; i < pairs; i++) {
        __m512bh w[TILE_PANELS];
#pragma GCC unroll 3
        for (int v = 0; v < V; v++) {
            const uint16_t *src = p + (v * pairs + i) * PAIRS_PER_PANEL;
            if (pf) __builtin_prefetch(pf + (v * pairs + i) * PAIRS_PER_PANEL, 0, 3);
            w[v] = (__m512bh)_mm512_loadu_si512((const void *)src);
        }
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            uint32_t pair;
            memcpy(&pair, xb + r * ldx + 2 * i, 4);
            const __m512bh b = (__m512bh)_mm512_set1_epi32((int)pair);
#pragma GCC unroll 3
            for (int v = 0; v < V; v++) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], w[v], b);
        }
    }
    float out[TILE_ROWS][TILE_PANELS * PANEL];
    for (int r = 0; r < R; r++)
        for (int v = 0; v < V; v++) _mm512_storeu_ps(out[r] + v * PANEL, acc[r][v]);
#else
    float out[TILE_ROWS][TILE_PANELS * PANEL];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < V * PANEL; c++) out[r][c] = 0.0f;
    for (int64_t i = 0; i < pairs; i++) {
        if (pf) __builtin_prefetch(pf + i * PAIRS_PER_PANEL, 0, 3);
        for (int r = 0; r < R; r++) {
            const float x0 = from_bf16(xb[r * ldx + 2 * i]), x1 = from_bf16(xb[r * ldx + 2 * i + 1]);
            for (int v = 0; v < V; v++) {
                const uint16_t *src = p + (v * pairs + i) * PAIRS_PER_PANEL;
                for (int j = 0; j < PANEL; j++) {
                    float a = out[r][v * PANEL + j];
                    a = __builtin_fmaf(x1, from_bf16(src[2 * j + 1]), a);
                    out[r][v * PANEL + j] = __builtin_fmaf(x0, from_bf16(src[2 * j]), a);
                }
            }
        }
    }
#endif
    for (int r = 0; r < R; r++)
        for (int64_t c = 0; c < cols; c++) y[r * ldy + c] = bias ? out[r][c] + bias[c] : out[r][c];
}

typedef void (*tile_fn)(const uint16_t *, int64_t, const uint16_t *, int64_t, float *, int64_t, const float *,
                        int64_t, const uint16_t *);
#define TILE_FN(R, V)                                                                                          \
    static void tile_##R##_##V(const uint16_t *p, int64_t k, const uint16_t *x, int64_t ldx, float *y,          \
                               int64_t ldy, const float *bias, int64_t cols, const uint16_t *pf) {             \
        tile(p, k, x, ldx, y, ldy, bias, cols, pf, R, V);                                                      \
    }
#define TILE_FNS(V) \
    TILE_FN(1, V) TILE_FN(2, V) TILE_FN(3, V) TILE_FN(4, V) TILE_FN(5, V) TILE_FN(6, V) TILE_FN(7, V) TILE_FN(8, V)
TILE_FNS(1)
TILE_FNS(2)
TILE_FNS(3)
static const tile_fn TILES[TILE_PANELS][TILE_ROWS] = {
    {tile_1_1, tile_2_1, tile_3_1, tile_4_1, tile_5_1, tile_6_1, tile_7_1, tile_8_1},
    {tile_1_2, tile_2_2, tile_3_2, tile_4_2, tile_5_2, tile_6_2, tile_7_2, tile_8_2},
    {tile_1_3, tile_2_3, tile_3_3, tile_4_3, tile_5_3, tile_6_3, tile_7_3, tile_8_3},
};

static __thread uint16_t *rows_buf; /* this thread's chunk of bfloat16 rows */
static __thread int64_t rows_cap;

/* output panels q0..q1-1 of rows m0..m1-1 of x converted in xb (row r of x at xb row r - m0) */
static void chunk_panels(const uint16_t *p, const uint16_t *xb, const float *bias, float *y, int64_t m0, int64_t m1,
                         int64_t n, int64_t k, int64_t q0, int64_t q1) {
    for (int64_t q = q0; q < q1; q += TILE_PANELS) {
        const int64_t v = q1 - q < TILE_PANELS ? q1 - q : TILE_PANELS;
        const int64_t col = q * PANEL, cols = n - col < v * PANEL ? n - col : v * PANEL;
        const uint16_t *panels = p + q * k * PANEL;
        const uint16_t *next = q + TILE_PANELS < q1 ? panels + TILE_PANELS * k * PANEL : 0;
        for (int64_t r = m0; r < m1; r += TILE_ROWS) {
            const int64_t rows = m1 - r < TILE_ROWS ? m1 - r : TILE_ROWS;
            TILES[v - 1][rows - 1](panels, k, xb + (r - m0) * k, k, y + r * n + col, n, bias ? bias + col : 0, cols,
                                   r == m0 ? next : 0);
        }
    }
}

void pdserve_bf16_panels(const uint16_t *p, const float *x, const float *bias, float *y, int64_t m, int64_t n,
                         int64_t k, int64_t q0, int64_t q1) {
    int64_t mc = (MC_BYTES / 2 / (k > 0 ? k : 1)) / TILE_ROWS * TILE_ROWS;
    if (mc < TILE_ROWS) mc = TILE_ROWS;
    if (mc > m) mc = m;
    if (mc * k > rows_cap) {
        free(rows_buf);
        rows_buf = (uint16_t *)aligned_alloc(64, (size_t)((mc * k * 2 + 63) / 64 * 64));
        rows_cap = rows_buf ? mc * k : 0;
    }
    if (!rows_buf) { /* no memory: one row at a time from the stack (the same values) */
        uint16_t *row = (uint16_t *)__builtin_alloca((size_t)k * 2);
        for (int64_t r = 0; r < m; r++) {
            pdserve_round_bf16(x + r * k, row, k);
            chunk_panels(p, row, bias, y, r, r + 1, n, k, q0, q1);
        }
        return;
    }
    for (int64_t m0 = 0; m0 < m; m0 += mc) {
        const int64_t m1 = m0 + mc < m ? m0 + mc : m;
        pdserve_round_bf16(x + m0 * k, rows_buf, (m1 - m0) * k);
        chunk_panels(p, rows_buf, bias, y, m0, m1, n, k, q0, q1);
    }
}

int32_t pdserve_packed_bf16(const uint16_t *p, const float *x, const float *bias, float *y, int64_t m, int64_t n,
                            int64_t k, int32_t num_threads) {
    if (k % 2) return -1;
    const int64_t panels = (n + PANEL - 1) / PANEL;
    int threads = num_threads < 1 ? 1 : num_threads;
    if (threads > panels) threads = (int)(panels > 0 ? panels : 1);
    if (m < 1) return 0;
    if (threads == 1) {
        pdserve_bf16_panels(p, x, bias, y, m, n, k, 0, panels);
        return 0;
    }
#pragma omp parallel num_threads(threads)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        pdserve_bf16_panels(p, x, bias, y, m, n, k, panels * t / nt, panels * (t + 1) / nt);
    }
    return 0;
}

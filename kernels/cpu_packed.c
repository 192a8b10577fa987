/* The float32 product of every linear layer on the native path: y[m, n] = x[m, k] . W[n, k]^T (+ bias[n]),
 * against the weight packed once at load into panels of PANEL output features.
 *
 * Packed layout (pdserve_pack_f32): panel q holds features q*PANEL .. q*PANEL+PANEL-1 as [k][PANEL]
 * (feature-minor), panels one after another, the last one zero-padded: ceil(n / PANEL) * k * PANEL floats.
 * Each k step of a panel is then one vector of PANEL weights, so the product is a register tile of R
 * activation rows x V panels (R*V vector accumulators): per k step V vector loads, R broadcasts of x[r][i]
 * and R*V FMAs, no horizontal sums. The tile keeps the V panels' weights in L1/L2 for the next R rows; the
 * rows are taken in chunks of MC_BYTES of activations (they stay in L2 while every panel passes them), so
 * one kernel serves a decode step's few rows and a prompt chunk's thousands.
 *
 * Every output is one FMA chain over k in order (acc = w[i] * x[i] + acc from 0, then + bias): the value
 * of y[r][f] depends on row r of x and feature f of W only, not on the row count, the tile, the thread
 * split or the build's vector width. So a token's products are bitwise the same in a prompt chunk and in
 * a decode step, in the per-op path and the whole-decoder path (cpu_decoder.c), on every thread count.
 *
 * Tiles: with AVX-512, 8 rows x 3 panels (24 zmm accumulators; 2-core AMD EPYC Zen 5, every product of
 * SmolLM2-135M at 16 rows, 1 thread, weights from DRAM: 8x3 26-30 ms, 8x2 31, 4x4 31-33, 16x1 58); other
 * builds 6 rows x 1 panel (12 AVX2 registers for 6 x 16 floats). While the first row tile of a panel group
 * runs on the first row chunk, the next group's panels are prefetched (one line per panel and k step),
 * so the weight stream from DRAM overlaps the arithmetic (decode products 29.5 -> 24.7 ms, 1 thread).
 */
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "cpu_internal.h"

#if defined(__AVX512F__)
#define VW 16 /* floats per vector register */
#define TILE_ROWS 8
#define TILE_PANELS PACKED_TILE_PANELS
#else
#define VW 8
#define TILE_ROWS 6
#define TILE_PANELS PACKED_TILE_PANELS
#endif
#define VPP (PANEL / VW)              /* vectors per panel's k step */
#define MC_BYTES (256 * 1024)         /* activation rows per chunk: about this many bytes of x */
typedef float vw __attribute__((vector_size(VW * 4)));
typedef float vwu __attribute__((vector_size(VW * 4), aligned(4), may_alias));

void pdserve_pack_f32(const float *w, float *p, int64_t n, int64_t k) {
    const int64_t panels = (n + PANEL - 1) / PANEL;
    for (int64_t q = 0; q < panels; q++) {
        float *dst = p + q * k * PANEL;
        for (int j = 0; j < PANEL; j++) {
            const int64_t f = q * PANEL + j;
            if (f < n) {
                const float *src = w + f * k;
                for (int64_t i = 0; i < k; i++) dst[i * PANEL + j] = src[i];
            } else {
                for (int64_t i = 0; i < k; i++) dst[i * PANEL + j] = 0.0f;
            }
        }
    }
}

/* R rows x V panels; `cols` valid output columns (< V*PANEL at the end of n); `pf`: panels to prefetch */
static inline __attribute__((always_inline)) void tile(const float *p, int64_t k, const float *x, int64_t ldx,
                                                       float *y, int64_t ldy, const float *bias, int64_t cols,
                                                       const float *pf, const int R, const int V) {
    vw acc[TILE_ROWS][TILE_PANELS * VPP];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
#pragma GCC unroll 6
        for (int u = 0; u < V * VPP; u++) acc[r][u] = (vw){0};
    for (int64_t i = 0; i < k; i++) {
        vw w[TILE_PANELS * VPP];
#pragma GCC unroll 3
        for (int v = 0; v < V; v++) {
            const float *src = p + (v * k + i) * PANEL;
            if (pf) __builtin_prefetch(pf + (v * k + i) * PANEL, 0, 3);
#pragma GCC unroll 2
            for (int h = 0; h < VPP; h++) w[v * VPP + h] = *(const vwu *)(src + h * VW);
        }
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            const vw b = (vw){0} + x[r * ldx + i];
#pragma GCC unroll 6
            for (int u = 0; u < V * VPP; u++) acc[r][u] = w[u] * b + acc[r][u];
        }
    }
    if (cols == V * PANEL) {
#pragma GCC unroll 8
        for (int r = 0; r < R; r++)
#pragma GCC unroll 6
            for (int u = 0; u < V * VPP; u++) {
                vw out = acc[r][u];
                if (bias) out = out + *(const vwu *)(bias + u * VW);
                *(vwu *)(y + r * ldy + u * VW) = out;
            }
        return;
    }
    for (int r = 0; r < R; r++) {
        float row[TILE_PANELS * PANEL];
        for (int u = 0; u < V * VPP; u++) memcpy(row + u * VW, &acc[r][u], sizeof(vw));
        for (int64_t c = 0; c < cols; c++) y[r * ldy + c] = bias ? row[c] + bias[c] : row[c];
    }
}

typedef void (*tile_fn)(const float *, int64_t, const float *, int64_t, float *, int64_t, const float *, int64_t,
                        const float *);
#define TILE_FN(R, V)                                                                                        \
    static void tile_##R##_##V(const float *p, int64_t k, const float *x, int64_t ldx, float *y, int64_t ldy, \
                               const float *bias, int64_t cols, const float *pf) {                           \
        tile(p, k, x, ldx, y, ldy, bias, cols, pf, R, V);                                                    \
    }
#define TILE_FNS(V) TILE_FN(1, V) TILE_FN(2, V) TILE_FN(3, V) TILE_FN(4, V) TILE_FN(5, V) TILE_FN(6, V)
TILE_FNS(1)
#if TILE_PANELS == 3
TILE_FNS(2)
TILE_FNS(3)
TILE_FN(7, 1) TILE_FN(8, 1) TILE_FN(7, 2) TILE_FN(8, 2) TILE_FN(7, 3) TILE_FN(8, 3)
static const tile_fn TILES[TILE_PANELS][TILE_ROWS] = {
    {tile_1_1, tile_2_1, tile_3_1, tile_4_1, tile_5_1, tile_6_1, tile_7_1, tile_8_1},
    {tile_1_2, tile_2_2, tile_3_2, tile_4_2, tile_5_2, tile_6_2, tile_7_2, tile_8_2},
    {tile_1_3, tile_2_3, tile_3_3, tile_4_3, tile_5_3, tile_6_3, tile_7_3, tile_8_3},
};
#else
static const tile_fn TILES[TILE_PANELS][TILE_ROWS] = {
    {tile_1_1, tile_2_1, tile_3_1, tile_4_1, tile_5_1, tile_6_1},
};
#endif

void pdserve_packed_panels(const float *p, const float *x, const float *bias, float *y, int64_t m, int64_t n,
                           int64_t k, int64_t q0, int64_t q1) {
    int64_t mc = (MC_BYTES / 4 / (k > 0 ? k : 1)) / TILE_ROWS * TILE_ROWS;
    if (mc < TILE_ROWS) mc = TILE_ROWS;
    for (int64_t m0 = 0; m0 < m; m0 += mc) {
        const int64_t m1 = m0 + mc < m ? m0 + mc : m;
        for (int64_t q = q0; q < q1; q += TILE_PANELS) {
            const int64_t v = q1 - q < TILE_PANELS ? q1 - q : TILE_PANELS;
            const int64_t col = q * PANEL, cols = n - col < v * PANEL ? n - col : v * PANEL;
            const float *panels = p + q * k * PANEL, *b = bias ? bias + col : 0;
            const float *next = m0 == 0 && q + TILE_PANELS < q1 ? panels + TILE_PANELS * k * PANEL : 0;
            for (int64_t r = m0; r < m1; r += TILE_ROWS) {
                const int64_t rows = m1 - r < TILE_ROWS ? m1 - r : TILE_ROWS;
                TILES[v - 1][rows - 1](panels, k, x + r * k, k, y + r * n + col, n, b, cols, r == m0 ? next : 0);
            }
        }
    }
}

void pdserve_packed_group(const float *panels, int64_t v, int64_t k, const float *x, int64_t m, float *y, int64_t ldy,
                          const float *bias, int64_t cols) {
    for (int64_t r = 0; r < m; r += TILE_ROWS) {
        const int64_t rows = m - r < TILE_ROWS ? m - r : TILE_ROWS;
        TILES[v - 1][rows - 1](panels, k, x + r * k, k, y + r * ldy, ldy, bias, cols, 0);
    }
}

void pdserve_packed_f32(const float *p, const float *x, const float *bias, float *y, int64_t m, int64_t n,
                        int64_t k, int32_t num_threads) {
    const int64_t panels = (n + PANEL - 1) / PANEL;
    int threads = num_threads < 1 ? 1 : num_threads;
    if (threads > panels) threads = (int)(panels > 0 ? panels : 1);
    if (threads == 1 || m < 1) {
        if (m >= 1) pdserve_packed_panels(p, x, bias, y, m, n, k, 0, panels);
        return;
    }
#pragma omp parallel num_threads(threads)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        pdserve_packed_panels(p, x, bias, y, m, n, k, panels * t / nt, panels * (t + 1) / nt);
    }
}

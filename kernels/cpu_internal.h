/* What the library's C files call in one another (kernels/cpu_native.py builds them into one library and
 * hashes this header with them). Hidden: none of this is part of the ctypes interface. */
#ifndef PDSERVE_CPU_INTERNAL_H
#define PDSERVE_CPU_INTERNAL_H

#include <stdint.h>

#include "cpu_simd.h"

#define INTERNAL __attribute__((visibility("hidden")))

/* cpu_attention.c: one paged-attention call's arguments (its header comment has the layout). The cache's
 * format: float32 or bfloat16 (q and out share it), or quantized (cpu_kv_codes.c; q and out float32) */
enum { DTYPE_F32 = 0, DTYPE_BF16 = 1, DTYPE_INT8 = 2, DTYPE_E4M3 = 3, DTYPE_E5M2 = 4, DTYPE_INT4 = 5 };

typedef struct {
    const void *q;
    const void *kv;
    void *out;
    const int32_t *query_start_loc;
    const int32_t *seq_lens;
    const int32_t *block_tables;
    int64_t q_token_stride;
    int32_t table_width, num_heads, kv_heads, head_dim, block_size, dtype;
    float scale;
    const float *scales; /* a quantized cache's scales (int4: its lows and steps) */
    const float *k_new, *v_new; /* a quantized cache: the step's K and V exact, token t's KV head h at */
    int64_t new_stride;         /* k_new + t * new_stride + h * head_dim */
    float *m_out, *l_out;       /* when set: each row's final running max and sum (cpu_attention_mass.c) */
} Args;

#define MAX_HEAD_DIM 256
#define ITEM_MAX_ROWS 32 /* the rows a row item holds at most */

typedef struct {
    int32_t seq, row_begin, row_end; /* rows are (token, query head) pairs, token-major */
} Item;

typedef void (*attend_fn)(const Args *, const Item *);

/* the kernel that attends one item for these arguments (head_dim and dtype specialised) */
INTERNAL attend_fn pdserve_attend_pick(const Args *a);

/* cpu_attention_blocked.c: prompt chunks. A sequence with at least BLK_MIN_QLEN new tokens, at most
 * BLK_MAX_QPK query heads per KV head and a head size that is a multiple of BLK_HEAD_DIM_STEP takes
 * items of BLK_TOKENS tokens (every head) */
#define BLK_TOKENS 8
#define BLK_MIN_QLEN 16
#define BLK_MAX_QPK 8
#define BLK_HEAD_DIM_STEP (2 * VW) /* whole steps of two of the build's vectors (cpu_simd.h) */

typedef struct {
    int32_t seq, tok0, tok1; /* tokens tok0..tok1-1 of the sequence's new ones, every head */
} BlockItem;

typedef void (*block_fn)(const Args *, const BlockItem *);
INTERNAL block_fn pdserve_block_pick(const Args *a);

/* One call's work: blocked items for the sequences that take the blocked kernel, row items for the rest,
 * and the kernels (head size and dtype specialised) that run them. Whatever the row items' size, a row's
 * values are the same: the per-op call and the one-call decoder plan with different sizes and agree
 * bitwise. */
typedef struct {
    BlockItem *blocks; /* run first: the larger pieces of work */
    Item *items;
    int64_t num_blocks, num_items;
    attend_fn attend;
    block_fn block;
} Plan;

/* plans the call (row items of `per_item` rows, as pdserve_plan_items); 0, or -5 when out of memory */
INTERNAL int pdserve_plan_attention(const Args *a, int32_t num_seqs, int32_t per_item, Plan *plan);
INTERNAL void pdserve_plan_free(Plan *plan);
/* runs the plan's items, taking them in turn through the counter *next (shared by a thread team) */
INTERNAL void pdserve_plan_work(const Args *a, const Plan *plan, int32_t *next);

/* Cut every sequence's rows into items of at most `per_item` rows (<= 0, or more than an item holds:
 * the default, as many whole tokens as fit); writes them to `items` unless it is NULL; returns how
 * many there are. A `per_item` that divides num_heads and is a multiple of the query heads per KV
 * head gives items of one token's KV head group each. */
INTERNAL int64_t pdserve_plan_items(const int32_t *query_start_loc, int32_t num_seqs, int32_t num_heads,
                                    int32_t per_item, Item *items);

/* cpu_kv_codes.c: a quantized cache read as float32 rows (its header comment has the formats) */
#define KV_INT4_GROUP 16 /* channels sharing one (low, step): kernels/kv_int4.py's GROUP */
/* bytes of one head's row in the cache (0 for float32 and bfloat16, which the kernels read in place) */
INTERNAL int64_t pdserve_kv_row_bytes(const Args *a);
/* K and V of positions pos0..pos0+n-1 (block table `table`), KV heads h_lo..h_hi, as float32: part p of
 * head h of key j at dst + j * key_stride + p * part_stride + (h - h_lo) * head_dim */
INTERNAL void pdserve_kv_tile(const Args *a, const int32_t *table, int pos0, int n, int h_lo, int h_hi, float *dst,
                              int64_t key_stride, int64_t part_stride);
/* A row over a quantized cache sees its own key and value exact, as the first key of its online softmax
 * (then the cached keys before it): its running max m = its own score (q, already scaled, against the new
 * K of `token`, the step's token index), sum l = 1, acc = its own V */
INTERNAL void pdserve_kv_own(const Args *a, int64_t token, int kv_head, const float *q, float *m, float *l,
                             float *acc);
/* One layer's write of a quantized cache: codes, scales, and the step's new K and V rows (token t's at
 * rows[0 or 1] + t * row_stride, its KV heads one after another) */
typedef struct {
    uint8_t *kv;
    float *scales;
    const float *rows[2];
    int64_t row_stride;
    int32_t fmt, bs, kvh, hd;
} KvWrite;
/* run_start[0..runs] = the first token of each run of consecutive tokens in one block (slots: block *
 * bs + offset; a block's new rows are contiguous), run_start[runs] = n; returns runs. A write is
 * runs x 2 x kv_heads independent tasks: */
INTERNAL int64_t pdserve_kv_runs(const int64_t *slots, int64_t n, int32_t bs, int64_t *run_start);
/* task (run, part, KV head): the block requantized with its run's rows, kernels/kv_quant.py's bytes */
INTERNAL void pdserve_kv_write_task(const KvWrite *w, const int64_t *slots, const int64_t *run_start, int64_t task);
/* this thread's buffer of at least `floats` floats (64-byte aligned, valid until its next call); aborts when
 * memory runs out */
INTERNAL float *pdserve_kv_scratch(int64_t floats);

/* cpu_attention_mass.c: the blocks' attention mass per KV head (its header comment has the arithmetic). A
 * call's items are MASS_SLOTS table slots of one sequence each; each item's sums land in its own
 * MASS_SLOTS x kv_heads floats of `sums`, and pdserve_mass_add adds them to the blocks' rows (`stride`
 * floats apart, KV head g at + g) in item order (one thread). */
#define MASS_SLOTS 8
#define MASS_MAX_QPK 64 /* query heads per KV head the pass takes */
typedef struct {
    int32_t seq, slot0, slot1; /* the sequence's table slots slot0..slot1-1 */
} MassItem;
typedef struct {
    MassItem *items;
    float *sums;
    int64_t num_items;
    void (*item)(const Args *, const MassItem *, float *);
} MassPlan;
/* plans a call over the step's sequences (a->m_out and a->l_out hold the rows' softmax max and sum when
 * the items run); 0, or -5 when out of memory */
INTERNAL int pdserve_mass_plan(const Args *a, int32_t num_seqs, MassPlan *plan);
INTERNAL void pdserve_mass_free(MassPlan *plan);
INTERNAL void pdserve_mass_work(const Args *a, const MassPlan *plan, int64_t i);
INTERNAL void pdserve_mass_add(const Args *a, const MassPlan *plan, float *mass, int64_t stride);

/* cpu_ops.c: the pieces of its kernels, for callers that already run inside an OpenMP team */
/* one row: h += d (d may be NULL), o = rms_norm(h) * wt */
INTERNAL void pdserve_add_rms_norm_row(float *h, const float *d, const float *wt, float *o, int64_t dim,
                                       float eps);
/* one token's first `heads` heads rotated in place */
INTERNAL void pdserve_rope_token(float *x, const float *c, const float *s, int32_t heads, int32_t head_dim);
/* o[i] = silu(g[i]) * u[i] for i in i0..i1 (i0 a multiple of 8: the same values as the whole row) */
INTERNAL void pdserve_silu_mul_range(const float *g, const float *u, float *o, int64_t i0, int64_t i1);

/* cpu_packed.c: the product against packed weights (its header comment has the layout). Output panels
 * q0..q1-1 (PANEL features each) of every row; cpu_decoder.c splits them over its threads. */
#define PANEL 16
#if defined(__AVX512F__)
#define PACKED_TILE_PANELS 3 /* the panels of one register tile (cpu_packed.c) */
#else
#define PACKED_TILE_PANELS 1
#endif
INTERNAL void pdserve_packed_panels(const float *p, const float *x, const float *bias, float *y, int64_t m,
                                    int64_t n, int64_t k, int64_t q0, int64_t q1);
/* m rows of x (row stride k) against v <= PACKED_TILE_PANELS panels at `panels`; y and bias start at the group's
 * first column, `cols` of its columns are written (rows of y ldy apart) */
INTERNAL void pdserve_packed_group(const float *panels, int64_t v, int64_t k, const float *x, int64_t m, float *y,
                                   int64_t ldy, const float *bias, int64_t cols);

/* cpu_qpacked.c: weights kept in GGUF blocks (its header comment has the layout). Formats of a packed matrix: */
enum { WF_F32 = 0, WF_Q4_0 = 1, WF_Q4_1 = 2, WF_Q8_0 = 3, WF_BF16 = 4 /* cpu_bf16.c's panels */, WF_Q4_K = 5, WF_Q6_K = 6,
       WF_KMIX = 7 /* Q4_K and Q6_K rows in Q6_K's records (gguf_blocks.py's KMIX rows) */,
       WF_FP8 = 8 /* an fp8 (e4m3) checkpoint's codes, a float32 scale per 32 inputs */, WF_Q5_0 = 9, WF_Q5_1 = 10,
       WF_Q5_K = 11 };
#define WF_KINDS 12 /* one past the largest format */
/* Q4_0's, Q4_1's and Q4_K's records plus a plane of fifth bits */
#define WF_Q5(fmt) ((fmt) == WF_Q5_0 || (fmt) == WF_Q5_1 || (fmt) == WF_Q5_K)
#define WF_BYTE_K(fmt) ((fmt) == WF_Q6_K || (fmt) == WF_KMIX) /* one record layout, one product */
/* IEEE half to float, exactly (the scalar path and the unpacking) */
static inline float pdserve_half_to_float(uint16_t h) {
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
/* bytes of one packed record (PANEL features x 32 inputs) of a kind (exported) */
int64_t pdserve_qrecord_bytes(int32_t fmt);
/* where a record's codes start, after its scales (float16 d; Q4_1 and Q5_1 also m; Q4_K, Q5_K float32 d and m; Q6_K and
 * KMIX float32 d of each half and m; FP8 a float32 d) */
static inline int64_t pdserve_qcodes_at(int32_t fmt) {
    return fmt == WF_Q4_1 || fmt == WF_Q5_1 || fmt == WF_FP8 ? 4 * PANEL
           : fmt == WF_Q4_K || fmt == WF_Q5_K                 ? 8 * PANEL
           : WF_BYTE_K(fmt)                                   ? 12 * PANEL
                                                              : 2 * PANEL;
}
#define TILE_ROWS_MAX 8 /* the most rows of one register tile: fewer rows read the weights once */
/* A format's flag: the product quantizes its activations to int8 and multiplies them with VNNI (cpu_qint8.c),
 * on the same packed records */
#define WF_I8 0x80
#define WF_KIND(fmt) ((fmt) & ~WF_I8)
/* output panels q0..q1-1 of every row for a matrix of format fmt (WF_F32: pdserve_packed_panels; WF_BF16:
 * pdserve_bf16_panels; WF_I8 set: the rows quantized once for the call, then pdserve_i8_panels) */
INTERNAL void pdserve_any_panels(int32_t fmt, const void *p, const float *x, const float *bias, float *y, int64_t m,
                                 int64_t n, int64_t k, int64_t q0, int64_t q1);

/* cpu_qint8.c: activation rows quantized to int8 per block of 32 inputs (its header comment has the
 * arithmetic): q [m][k] (a Q4 format's in its evens-then-odds order), and per row and block d (the scale),
 * ds = d * sum q, corr = offset * sum q (8 for Q4_0, 128 for Q8_0, 32 for Q6_K, 0 for Q4_1 and Q4_K) and lo,
 * the sum of the block's first 16 q (Q6_K's scales cover 16 inputs each) */
typedef struct {
    int8_t *q;
    float *d, *ds;
    int32_t *corr, *lo;
    int64_t m, k;
} QRows;
/* m rows of x (k inputs, a multiple of 32) for a product of kind fmt, in this thread's buffer (valid until
 * its next call); NULL where the build lacks AVX512-VNNI or memory runs out */
INTERNAL const QRows *pdserve_quantize_rows(int32_t fmt, const float *x, int64_t m, int64_t k);
/* 1 where this build has the int8 product (AVX512-VNNI and AVX512-BW), else 0 (exported) */
int32_t pdserve_i8_available(void);
/* output panels q0..q1-1 of every row of `a` against packed records of kind fmt (y: a->m rows of n) */
INTERNAL void pdserve_i8_panels(int32_t fmt, const uint8_t *p, const QRows *a, const float *bias, float *y,
                                int64_t n, int64_t q0, int64_t q1);

/* cpu_bf16.c: output panels q0..q1-1 of every row of x (float32, rounded to bfloat16 here) against bfloat16
 * panels (its header comment has the layout and the arithmetic; k even) */
INTERNAL void pdserve_bf16_panels(const uint16_t *p, const float *x, const float *bias, float *y, int64_t m,
                                  int64_t n, int64_t k, int64_t q0, int64_t q1);

#endif

/* A quantized KV cache on CPU: its writes, and a tile of keys converted to float32 rows, which the row and
 * blocked attention kernels (cpu_attention.c, cpu_attention_blocked.c) then read as they read a float32
 * cache.
 *
 * Formats (Args.dtype; the storage is kernels/kv_quant.py's and kernels/kv_int4.py's):
 * - DTYPE_INT8, DTYPE_E4M3, DTYPE_E5M2: one byte a value, [num_blocks, 2, block_size, kv_heads, head_dim],
 *   and one float32 scale per block, part and KV head ([num_blocks, 2, kv_heads]). A value is the code's
 *   value times its scale.
 * - DTYPE_INT4: two codes a byte (channel 2j in byte j's low nibble, 2j + 1 in its high one), [num_blocks,
 *   2, block_size, kv_heads, head_dim / 2], and (low, step) per block, part, KV head and group of 16
 *   channels ([num_blocks, 2, kv_heads, head_dim / 16, 2]). A value is code * step + low.
 *
 * Values are computed as the torch reference dequantizes them: one float32 product, then (int4) one float32
 * sum, never fused (fp-contract is off in this file). The write (pdserve_kv_write) is kernels/kv_quant.py's
 * requantize-on-write step for step, so its bytes equal the torch write's: the earlier rows of each touched
 * block dequantized, the new rows put in, later rows zero, the block's scale (or each group's low and step)
 * recomputed over it, every row quantized again (division, round half to even, clamp; fp8 codes rounded to
 * nearest even as torch converts). tests/unit/test_native_kv_codes.py compares bytes and attention with
 * the torch reference.
 *
 * As in the torch reference and the Triton kernel, a query row sees its own token's K and V exact (the
 * step's, `k_new`/`v_new`), not read back from the codes: the kernels take them as the first key of the
 * row's online softmax (pdserve_kv_own) and then visit the cached keys before the row's own position.
 *
 * Reading a tile costs a conversion per value (a few vector instructions per 16 values) where a float32
 * cache costs none, for a quarter (8-bit) or an eighth (int4) of the bytes.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_internal.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#pragma GCC optimize("fp-contract=off")

/* 16 lanes whatever the build's vectors (GCC splits them where AVX-512 is missing) */
typedef float f16v __attribute__((vector_size(64)));
typedef float f16vu __attribute__((vector_size(64), aligned(4), may_alias));
typedef int32_t i16v __attribute__((vector_size(64)));
typedef uint32_t u16v __attribute__((vector_size(64)));

static inline f16v sel(i16v m, f16v a, f16v b) { return (f16v)((m & (i16v)a) | (~m & (i16v)b)); }

/* 16 bytes widened to 32-bit lanes (signed or not), and 16 lanes' low bytes stored: GCC 12 turns
 * __builtin_convertvector between these widths into scalar code, so AVX-512 builds say it directly */
static inline u16v widen_u8(const uint8_t *p) {
#if defined(__AVX512F__)
    return (u16v)_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
#else
    u16v r;
    for (int i = 0; i < 16; i++) r[i] = p[i];
    return r;
#endif
}

static inline i16v widen_s8(const uint8_t *p) {
#if defined(__AVX512F__)
    return (i16v)_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p));
#else
    i16v r;
    for (int i = 0; i < 16; i++) r[i] = (int8_t)p[i];
    return r;
#endif
}

static inline void store_low_bytes(u16v x, uint8_t *p) {
#if defined(__AVX512F__)
    _mm_storeu_si128((__m128i *)p, _mm512_cvtepi32_epi8((__m512i)x));
#else
    for (int i = 0; i < 16; i++) p[i] = (uint8_t)x[i];
#endif
}

/* round half to even, for |x| < 2^22 (torch.round's rule, in the default rounding mode) */
static inline f16v round_even(f16v x) { return (x + 12582912.0f) - 12582912.0f; }

/* the values of 16 8-bit codes (int8, or fp8 through its bits: the normal range by moving the exponent
 * and mantissa into place and multiplying by the bias difference, subnormals as m * 2^-k, NaN and inf
 * codes as such) */
static inline f16v decode8(int32_t fmt, const uint8_t *p) {
    if (fmt == DTYPE_INT8) return __builtin_convertvector(widen_s8(p), f16v);
#if defined(__AVX512F__) && defined(__F16C__)
    /* fp8 as half precision, which the hardware widens exactly (subnormals too): e5m2 is a half's top byte;
     * e4m3's exponent lands 8 below a half's bias (times 256 puts it back), and its NaN codes are no
     * half's NaN */
    const __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p));
    if (fmt == DTYPE_E5M2) return (f16v)_mm512_cvtph_ps(_mm256_slli_epi16(w, 8));
    const __m256i mag = _mm256_and_si256(w, _mm256_set1_epi16(0x7f));
    const __m256i half = _mm256_or_si256(_mm256_slli_epi16(mag, 7),
                                         _mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x80)), 8));
    const f16v v = (f16v)_mm512_cvtph_ps(half) * 256.0f;
    const i16v nan = (i16v)_mm512_cvtepi16_epi32(_mm256_cmpeq_epi16(mag, _mm256_set1_epi16(0x7f)));
    return sel(nan, (f16v){0} + NAN, v);
#else
    const u16v b = widen_u8(p);
    const u16v mag = b & 0x7f, sign = (b & 0x80) << 24;
    f16v v;
    if (fmt == DTYPE_E4M3) {
        v = (f16v)(mag << 20) * 0x1p120f;
        v = sel((i16v)((mag >> 3) == 0), __builtin_convertvector(mag & 7, f16v) * 0x1p-9f, v);
        v = sel((i16v)(mag == 0x7f), (f16v){0} + NAN, v);
    } else {
        v = (f16v)(mag << 21) * 0x1p112f;
        v = sel((i16v)((mag >> 2) == 0), __builtin_convertvector(mag & 3, f16v) * 0x1p-16f, v);
        v = sel((i16v)((mag >> 2) == 31), sel((i16v)((mag & 3) == 0), (f16v){0} + INFINITY, (f16v){0} + NAN), v);
    }
    return (f16v)((u16v)v | sign);
#endif
}

/* the codes of 16 values already divided by their scale and clamped to the format's range (int8: rounded
 * half to even; fp8: torch's conversion, rounded to nearest even), in the low bytes of the lanes */
static inline u16v encode8(int32_t fmt, f16v y) {
    if (fmt == DTYPE_INT8) return (u16v)__builtin_convertvector(round_even(y), i16v);
    u16v bits = (u16v)y;
    const u16v sign = bits & 0x80000000u;
    bits ^= sign;
    u16v r;
    if (fmt == DTYPE_E4M3) {
        const uint32_t denorm = 141u << 23;
        const u16v sub = (u16v)((f16v)bits + 0x1p14f) - denorm;
        const u16v odd = (bits >> 20) & 1;
        const u16v norm = (bits + ((uint32_t)(7 - 127) << 23) + 0x7ffff + odd) >> 20;
        r = (u16v)sel((i16v)(bits < (121u << 23)), (f16v)sub, (f16v)norm);
        r = (u16v)sel((i16v)(bits >= (1087u << 20)), (f16v)((u16v){0} + 0x7f), (f16v)r);
    } else {
        const uint32_t denorm = 134u << 23;
        const u16v sub = (u16v)((f16v)bits + 0x1p7f) - denorm;
        const u16v odd = (bits >> 21) & 1;
        const u16v norm = (bits + ((uint32_t)(15 - 127) << 23) + 0xfffff + odd) >> 21;
        r = (u16v)sel((i16v)(bits < (113u << 23)), (f16v)sub, (f16v)norm);
        const f16v nan_inf = sel((i16v)(bits > (255u << 23)), (f16v)((u16v){0} + 0x7f), (f16v)((u16v){0} + 0x7c));
        r = (u16v)sel((i16v)(bits >= (143u << 23)), nan_inf, (f16v)r);
    }
    return (r & 0xff) | (sign >> 24);
}

/* a group of 16 int4 channels (8 bytes: channel i in nibble i of the little-endian word) */
static inline f16v decode4(const uint8_t *p, float low, float step) {
    uint64_t w;
    memcpy(&w, p, 8);
    const uint32_t lo = (uint32_t)w, hi = (uint32_t)(w >> 32);
    const u16v words = {lo, lo, lo, lo, lo, lo, lo, lo, hi, hi, hi, hi, hi, hi, hi, hi};
    const u16v shift = {0, 4, 8, 12, 16, 20, 24, 28, 0, 4, 8, 12, 16, 20, 24, 28};
    const f16v c = __builtin_convertvector((i16v)((words >> shift) & 15), f16v);
    return c * step + low;
}

int64_t pdserve_kv_row_bytes(const Args *a) {
    if (a->dtype == DTYPE_INT4) return a->head_dim / 2;
    return a->dtype >= DTYPE_INT8 ? a->head_dim : 0;
}

/* one head's row of values (hd a multiple of 16) */
static void decode_row(int32_t fmt, const uint8_t *src, const float *scale, float *dst, int hd) {
    if (fmt == DTYPE_INT4) {
        for (int g = 0; g < hd / KV_INT4_GROUP; g++) {
            *(f16vu *)(dst + g * KV_INT4_GROUP) = decode4(src + g * (KV_INT4_GROUP / 2), scale[2 * g], scale[2 * g + 1]);
        }
    } else {
        const float s = *scale;
        for (int d = 0; d < hd; d += 16) *(f16vu *)(dst + d) = decode8(fmt, src + d) * s;
    }
}

void pdserve_kv_tile(const Args *a, const int32_t *table, int pos0, int n, int h_lo, int h_hi, float *dst,
                     int64_t key_stride, int64_t part_stride) {
    const int hd = a->head_dim, bs = a->block_size, kvh = a->kv_heads;
    const int64_t row_bytes = pdserve_kv_row_bytes(a), key_bytes = kvh * row_bytes;
    const int64_t per_head = a->dtype == DTYPE_INT4 ? 2 * (hd / KV_INT4_GROUP) : 1; /* scale floats */
    const uint8_t *kv = (const uint8_t *)a->kv;
    for (int j = 0; j < n; j++) {
        const int pos = pos0 + j;
        const int64_t block = table[pos / bs];
        for (int part = 0; part < 2; part++) {
            const uint8_t *row = kv + ((block * 2 + part) * bs + pos % bs) * key_bytes;
            const float *sc = a->scales + (block * 2 + part) * kvh * per_head;
            for (int h = h_lo; h <= h_hi; h++) {
                decode_row(a->dtype, row + h * row_bytes, sc + h * per_head,
                           dst + j * key_stride + part * part_stride + (int64_t)(h - h_lo) * hd, hd);
            }
        }
    }
}

void pdserve_kv_own(const Args *a, int64_t token, int kv_head, const float *q, float *m, float *l,
                    float *acc) {
    const int hd = a->head_dim;
    const int64_t off = token * a->new_stride + (int64_t)kv_head * hd;
    float s = 0.0f;
    for (int d = 0; d < hd; d++) s += q[d] * a->k_new[off + d];
    for (int d = 0; d < hd; d++) acc[d] = a->v_new[off + d];
    *m = s;
    *l = 1.0f;
}

static __thread float *scratch; /* this thread's converted rows (pdserve_kv_scratch), grown as needed */
static __thread int64_t scratch_floats;

float *pdserve_kv_scratch(int64_t floats) {
    if (floats > scratch_floats) {
        free(scratch);
        scratch = (float *)aligned_alloc(64, (size_t)((floats * 4 + 63) & ~(int64_t)63));
        if (!scratch) {
            fprintf(stderr, "pdserve: out of memory for %lld floats of KV rows\n", (long long)floats);
            abort();
        }
        scratch_floats = floats;
    }
    return scratch;
}

/* ---- the write ---- */

/* Requantize one block's part and KV head: rows 0..start-1 as stored, rows start..end the new ones (tokens
 * t0.. of the write), rows after end zero. */
static void write_block(const KvWrite *w, int64_t block, int part, int head, int start, int end, int64_t t0) {
    const int hd = w->hd, bs = w->bs;
    const int64_t groups = hd / KV_INT4_GROUP, per_head = w->fmt == DTYPE_INT4 ? 2 * groups : 1;
    const int64_t row_bytes = w->fmt == DTYPE_INT4 ? hd / 2 : hd, key_bytes = w->kvh * row_bytes;
    float *buf = pdserve_kv_scratch((int64_t)bs * hd);
    uint8_t *rows = w->kv + (block * 2 + part) * bs * key_bytes + head * row_bytes;
    float *sc = w->scales + ((block * 2 + part) * w->kvh + head) * per_head;
    for (int r = 0; r < bs; r++) {
        float *o = buf + r * hd;
        if (r < start) {
            decode_row(w->fmt, rows + r * key_bytes, sc, o, hd);
        } else if (r <= end) {
            memcpy(o, w->rows[part] + (t0 + r - start) * w->row_stride + (int64_t)head * hd, (size_t)hd * 4);
        } else {
            memset(o, 0, (size_t)hd * 4);
        }
    }
    if (w->fmt == DTYPE_INT4) {
        for (int64_t g = 0; g < groups; g++) {
            f16v lo = (f16v){0} + INFINITY, hi = (f16v){0} - INFINITY;
            for (int r = 0; r <= end; r++) {
                const f16v x = *(const f16vu *)(buf + r * hd + g * KV_INT4_GROUP);
                lo = sel((i16v)(x < lo), x, lo);
                hi = sel((i16v)(x > hi), x, hi);
            }
            float low = lo[0], high = hi[0];
            for (int i = 1; i < 16; i++) {
                low = lo[i] < low ? lo[i] : low;
                high = hi[i] > high ? hi[i] : high;
            }
            float step = (high - low) / 15.0f;
            step = step < 1e-12f ? 1e-12f : step;
            sc[2 * g] = low;
            sc[2 * g + 1] = step;
            for (int r = 0; r < bs; r++) {
                uint8_t *dst = rows + r * key_bytes + g * (KV_INT4_GROUP / 2);
                if (r > end) {
                    memset(dst, 0, KV_INT4_GROUP / 2);
                    continue;
                }
                const f16v x = *(const f16vu *)(buf + r * hd + g * KV_INT4_GROUP);
                f16v c = round_even((x - low) / step);
                c = sel((i16v)(c < 0.0f), (f16v){0}, c);
                c = sel((i16v)(c > 15.0f), (f16v){0} + 15.0f, c);
                const u16v q = __builtin_convertvector(c, u16v);
                for (int j = 0; j < KV_INT4_GROUP / 2; j++) dst[j] = (uint8_t)(q[2 * j] | (q[2 * j + 1] << 4));
            }
        }
        return;
    }
    const float qmax = w->fmt == DTYPE_INT8 ? 127.0f : w->fmt == DTYPE_E4M3 ? 448.0f : 57344.0f;
    f16v amax = {0};
    for (int64_t i = 0; i < (int64_t)bs * hd; i += 16) {
        const f16v x = *(const f16vu *)(buf + i);
        const f16v ax = (f16v)((i16v)x & 0x7fffffff);
        amax = sel((i16v)(ax > amax), ax, amax);
    }
    float m = amax[0];
    for (int i = 1; i < 16; i++) m = amax[i] > m ? amax[i] : m;
    float s = m / qmax;
    s = s < 1e-12f ? 1e-12f : s;
    *sc = s;
    for (int r = 0; r < bs; r++) {
        for (int d = 0; d < hd; d += 16) {
            f16v y = *(const f16vu *)(buf + r * hd + d) / s;
            y = sel((i16v)(y < -qmax), (f16v){0} - qmax, y);
            y = sel((i16v)(y > qmax), (f16v){0} + qmax, y);
            store_low_bytes(encode8(w->fmt, y), rows + r * key_bytes + d);
        }
    }
}

int64_t pdserve_kv_runs(const int64_t *slots, int64_t n, int32_t bs, int64_t *run_start) {
    int64_t runs = 0;
    for (int64_t t = 0; t < n; t++) {
        if (t == 0 || slots[t] / bs != slots[t - 1] / bs) run_start[runs++] = t;
    }
    run_start[runs] = n;
    return runs;
}

void pdserve_kv_write_task(const KvWrite *w, const int64_t *slots, const int64_t *run_start, int64_t task) {
    const int64_t run = task / (2 * w->kvh);
    const int part = (int)(task / w->kvh % 2), head = (int)(task % w->kvh);
    const int64_t t0 = run_start[run], t1 = run_start[run + 1];
    write_block(w, slots[t0] / w->bs, part, head, (int)(slots[t0] % w->bs), (int)(slots[t1 - 1] % w->bs), t0);
}

/* The write alone (the per-layer path): k and v [num_tokens, kv_heads, head_dim] float32 at `slots`
 * (block * block_size + offset; a block's new rows contiguous). 0, or a negative code. */
int32_t pdserve_kv_write(void *kv, float *scales, int32_t fmt, const float *k, const float *v,
                         const int64_t *slots, int64_t num_tokens, int32_t block_size, int32_t kv_heads,
                         int32_t head_dim, int32_t num_threads) {
    if (fmt < DTYPE_INT8 || fmt > DTYPE_INT4) return -4;
    if (head_dim <= 0 || head_dim % 16 != 0 || head_dim > MAX_HEAD_DIM) return -1;
    if (block_size <= 0 || (block_size & (block_size - 1)) != 0) return -3;
    const KvWrite w = {(uint8_t *)kv, scales, {k, v}, (int64_t)kv_heads * head_dim, fmt, block_size, kv_heads,
                       head_dim};
    int64_t *run_start = (int64_t *)malloc((size_t)(num_tokens + 1) * sizeof(int64_t));
    if (!run_start) return -5;
    const int64_t tasks = pdserve_kv_runs(slots, num_tokens, block_size, run_start) * 2 * kv_heads;
    int threads = num_threads < 1 ? 1 : num_threads;
    if (threads > tasks) threads = (int)(tasks > 0 ? tasks : 1);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t task = 0; task < tasks; task++) pdserve_kv_write_task(&w, slots, run_start, task);
    free(run_start);
    return 0;
}

/* Paged attention on CPU, reading K/V in place from the paged cache (no gather).
 *
 * Layout (kernels/attention.py): the layer's cache is [num_blocks, 2, block_size,
 * kv_heads, head_dim] (K at index 0 of dim 1, V at 1); q and out are
 * [num_tokens, num_heads, head_dim] (q's token stride may be larger, for views).
 * Sequence s owns query rows query_start_loc[s]..query_start_loc[s+1]; its new
 * token i sits at position seq_lens[s] - q_len + i and sees keys at positions <= its own.
 *
 * Work item: one sequence and up to ITEM_MAX_ROWS (token, query head) rows (pdserve_plan_items: as many
 * whole tokens as fit; the native decoder's items are one token's KV head group). The item's rows are
 * grouped by KV head, and keys are visited in tiles of KEY_TILE positions (gathered across KV blocks
 * through the block table) with an online softmax per row (running max m, running sum l, float32
 * accumulators), as flash-decoding does. Per tile and KV head group: each row's scores, VW keys at a
 * time (one FMA chain per key over the head, then a transposing reduction), the rows' rescale factors in
 * one vector exp, each row's probabilities, then P.V for up to PV_ROWS rows at once, each V vector loaded
 * once for all of them. The next tile's K/V rows of the item's KV heads are prefetched, a share of the
 * keys before each row's work. Vectors are VW = 16 floats where the build has AVX-512, else 8.
 *
 * A row's arithmetic (its tiles, the order of every sum) depends on the row alone, not on the other rows
 * of its item nor on the thread count: the native decoder plans other items than this file does, and its
 * results must be bitwise this file's (tests/unit/test_native_decoder.py).
 *
 * Items are shared by `num_threads` OpenMP threads through an atomic counter: the library links
 * libgomp.so.1, which resolves to the copy torch loaded, so the kernel runs on torch's own thread team
 * rather than starting threads that would compete with torch's spinning ones. Cache, q and out are
 * float32 (dtype 0) or bfloat16 (dtype 1); a quantized cache (8-bit codes or int4, cpu_kv_codes.c) is
 * read a tile at a time, converted to float32 rows, with q and out float32.
 *
 * Measured on a 2-core Zen 5 (AVX-512) VM with a standalone harness (gcc -O3 -march=native) that calls
 * this file's pdserve_paged_attention (whole-token items) or the native decoder's items through
 * pdserve_attend_pick: SmolLM2's shape (9 heads, 3 KV heads, head_dim 64, blocks of 16 in random order,
 * float32), 16 sequences x 288 keys x 30 layers, best of 7, median of 3 runs interleaved with the row
 * kernel this replaced (a row at a time inside each 16-key tile, 8-float vectors), in ms:
 *                                  1 thread        2 threads       1024 keys: 1 thread, 2 threads
 *   decoder's items (a KV group):  16.9 -> 13.1    10.4 -> 7.8     61.8 -> 46.8    39.2 -> 30.5
 *   whole-token items:             12.3 -> 12.3     7.8 -> 7.4     41.2 -> 44.2    26.1 -> 27.0
 *   K/V in L1 (arithmetic alone):  0.88 -> 0.42 (decoder's items), 0.72 -> 0.40 ms per 4 layers
 * Decode is memory-bound there: the host then streamed ~34 GB/s on 2 threads (~37 on 1; its bandwidth
 * varies with the neighbours: 40-75 GB/s at other times), and a loop that only reads the same lines in the
 * same order (random 24 KB blocks, 4 KB pages) took 11.4 (12.9 for a KV group's strided lines) ms on 1
 * thread and 6.9 (7.7) on 2. Tiles of 16 or 64 keys, prefetching 2 tiles ahead, to L2 only, in the P.V
 * loop, or whole key rows (every KV head) for the decoder's items measured no better.
 *
 * Prompt chunks (a sequence with at least BLK_MIN_QLEN new tokens) take the blocked kernel of
 * cpu_attention_blocked.c instead; cpu_attention_plan.c plans a call and runs both kinds of item on one
 * thread team.
 *
 * Plain C with GCC vector extensions, so it builds on x86_64 (AVX-512 or not) and aarch64.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "cpu_internal.h"

#define KEY_TILE 32 /* keys per tile, gathered across KV blocks: a multiple of VW (16 and 64 measured slower) */

/* P.V's register budget for the build's vectors (cpu_simd.h's VW) */
#if VW == 16
#define PV_VECS 8  /* P.V: at most this many vectors of a head slice per pass over the tile's V rows (8 or 4) */
#define PV_ACCS 24 /* P.V: rows x vectors of sums kept in registers (of 32) */
#else
#define PV_VECS 4  /* 2 (fewer sums, twice the passes over V) measured slower */
#define PV_ACCS 12 /* of 16 registers */
#endif
#define PV_ROWS 4 /* at most this many rows of one KV head share each V row load (PV_ACCS permitting) */

static inline iw lane_ids(void) {
#if VW == 16
    return (iw){0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
#else
    return (iw){0, 1, 2, 3, 4, 5, 6, 7};
#endif
}

static inline vw vmaxw(vw a, vw b) {
    const iw a_wins = a > b;
    return (vw)(((iw)a & a_wins) | ((iw)b & ~a_wins));
}


/* the max of the lanes, by halves (the max of floats does not depend on the order, NaN aside) */
static inline float hmaxw(vw a) {
#if VW == 16
    v8 b = vmax8(__builtin_shufflevector(a, a, 0, 1, 2, 3, 4, 5, 6, 7),
                 __builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15));
#else
    v8 b = a;
#endif
    b = vmax8(b, __builtin_shuffle(b, (i32x8){4, 5, 6, 7, 0, 1, 2, 3}));
    b = vmax8(b, __builtin_shuffle(b, (i32x8){2, 3, 0, 1, 6, 7, 4, 5}));
    b = vmax8(b, __builtin_shuffle(b, (i32x8){1, 0, 3, 2, 5, 4, 7, 6}));
    return b[0];
}

/* One row's scores against the first nv keys of the tile (K rows at krow[j] + gofs; krow holds a whole
 * vector of valid rows), VW keys at a time: one FMA chain per key, then a transposing reduction.
 * Returns the max of the nv scores. */
static inline __attribute__((always_inline)) float row_scores(const float *q, const char *const *krow, int64_t gofs,
                                                              int nv, float *s, int hd, int bf16) {
    const int esize = bf16 ? 2 : 4;
    vw vmax = splatw(-INFINITY);
    for (int j0 = 0; j0 < nv; j0 += VW) {
        vw dots[VW];
        /* key by key: one K row pointer live at a time (16 would not fit the general registers) */
        for (int u = 0; u < VW; u++) {
            const char *kj = krow[j0 + u] + gofs;
            vw dot = *(const vw *)q * loadw(kj, bf16);
            for (int d = VW; d < hd; d += VW) dot += *(const vw *)(q + d) * loadw(kj + d * esize, bf16);
            dots[u] = dot;
        }
        const vw sc = reducew(dots);
        *(vw *)(s + j0) = sc;
        const iw keep = lane_ids() < nv - j0;
        vmax = vmaxw(vmax, (vw)(((iw)sc & keep) | ((iw)splatw(-INFINITY) & ~keep)));
    }
    return hmaxw(vmax);
}

/* rows[j] = the K row (KV head 0) of position pos0 + j of the sequence, for j < n: a block table look-up per
 * block, then a step per key */
static inline void key_rows(const char **rows, int pos0, int n, const char *kv, const int32_t *table, int bs,
                            int64_t block_bytes, int64_t key_bytes) {
    const int bs_shift = __builtin_ctz((unsigned)bs);
    for (int j = 0; j < n;) {
        const int pos = pos0 + j;
        const char *row = kv + table[pos >> bs_shift] * block_bytes + (pos & (bs - 1)) * key_bytes;
        const int end = j + bs - (pos & (bs - 1)) < n ? j + bs - (pos & (bs - 1)) : n;
        for (; j < end; j++, row += key_bytes) rows[j] = row;
    }
}

/* Prefetches the lines of bytes [row + off, row + off + bytes) of a K row and of its V row, v_off bytes on */
static inline __attribute__((always_inline)) void prefetch_kv(const char *row, int64_t off, int64_t bytes,
                                                              int64_t v_off) {
    const uintptr_t lo = (uintptr_t)(row + off), first = lo & ~(uintptr_t)63;
    for (uintptr_t x = first; x < lo + (uintptr_t)bytes; x += 64) {
        __builtin_prefetch((const char *)x, 0, 3);
        __builtin_prefetch((const char *)x + v_off, 0, 3);
    }
}

/* pv_rows on the w vectors of head columns dc.. (w a compile-time constant, for the sums to stay in
 * registers) */
static inline __attribute__((always_inline)) void pv_slice(float *acc, const float *p, const int8_t *rows, int nr,
                                                           const float *alpha, const char *const *vrow, int64_t voff,
                                                           int nv, int hd, int dc, int w, int bf16) {
    const int esize = bf16 ? 2 : 4;
    vw o[PV_ROWS][PV_VECS];
    for (int r = 0; r < nr; r++) {
        for (int u = 0; u < w; u++) o[r][u] = *(vw *)(acc + rows[r] * hd + dc + u * VW) * alpha[rows[r]];
    }
    for (int j = 0; j < nv; j++) {
        const char *vj = vrow[j] + voff + dc * esize;
        vw v[PV_VECS];
        for (int u = 0; u < w; u++) v[u] = loadw(vj + u * VW * esize, bf16);
        for (int r = 0; r < nr; r++) {
            const float pj = p[rows[r] * KEY_TILE + j];
            for (int u = 0; u < w; u++) o[r][u] += pj * v[u];
        }
    }
    for (int r = 0; r < nr; r++) {
        for (int u = 0; u < w; u++) *(vw *)(acc + rows[r] * hd + dc + u * VW) = o[r][u];
    }
}

/* acc[r] = acc[r] * alpha[r] + sum_j p[r][j] V[j] for NR rows of one KV head that see the same nv keys (V rows
 * at vrow[j] + voff): each V vector is loaded once for all of them. A row's operations are the same whatever
 * NR is. */
static inline __attribute__((always_inline)) void pv_rows(float *acc, const float *p, const int8_t *rows, int nr,
                                                          const float *alpha, const char *const *vrow,
                                                          int64_t voff, int nv, int hd, int bf16) {
    const int nvec = hd / VW;
    int c = 0;
    /* slices of compile-time widths, whatever the head size (each column's sum is the same) */
    if (PV_VECS >= 8) {
        for (; c + 8 <= nvec; c += 8) pv_slice(acc, p, rows, nr, alpha, vrow, voff, nv, hd, c * VW, 8, bf16);
    }
    for (; c + 4 <= nvec; c += 4) pv_slice(acc, p, rows, nr, alpha, vrow, voff, nv, hd, c * VW, 4, bf16);
    for (; c < nvec; c++) pv_slice(acc, p, rows, nr, alpha, vrow, voff, nv, hd, c * VW, 1, bf16);
}

/* One work item; `hd` and `bf16` are compile-time constants in each specialisation. */
static inline __attribute__((always_inline)) void attend_item(const Args *a, const Item *it, int hd, int bf16) {
    float qbuf[ITEM_MAX_ROWS * MAX_HEAD_DIM] __attribute__((aligned(64)));
    float acc[ITEM_MAX_ROWS * MAX_HEAD_DIM] __attribute__((aligned(64)));
    float p[ITEM_MAX_ROWS * KEY_TILE] __attribute__((aligned(64))); /* a row's scores, then its probabilities */
    float m[ITEM_MAX_ROWS], l[ITEM_MAX_ROWS], alpha[ITEM_MAX_ROWS], mnew[ITEM_MAX_ROWS];
    int32_t last[ITEM_MAX_ROWS]; /* last visible key position of each row */
    int32_t nvis[ITEM_MAX_ROWS]; /* keys of the current tile each row sees */
    int64_t out_off[ITEM_MAX_ROWS];
    int32_t kvh[ITEM_MAX_ROWS];  /* each row's KV head */
    int8_t order[ITEM_MAX_ROWS]; /* the rows by KV head, then token: a group shares its K/V loads */
    int32_t grp_begin[ITEM_MAX_ROWS + 1], ngroups = 0;
    const char *rows_a[KEY_TILE], *rows_b[KEY_TILE]; /* K rows (KV head 0) of this tile and the next */
    const char **cur = rows_a, **nxt = rows_b;

    const int esize = bf16 ? 2 : 4;
    const int64_t qrow = pdserve_kv_row_bytes(a); /* a quantized head row's bytes, else 0 */
    const int qpk = a->num_heads / a->kv_heads;
    const int s = it->seq;
    const int q0 = a->query_start_loc[s];
    const int q_len = a->query_start_loc[s + 1] - q0;
    const int ctx = a->seq_lens[s] - q_len;
    const int nrows = it->row_end - it->row_begin;
    const int bs = a->block_size;
    const int64_t key_stride = (int64_t)a->kv_heads * hd; /* elements between consecutive keys */
    /* bytes of a key's row (every KV head) in the cache, and from a K row to its V row */
    const int64_t key_bytes = qrow ? a->kv_heads * qrow : key_stride * esize;
    const int64_t v_off = (int64_t)bs * key_bytes;
    const int32_t *table = a->block_tables + (int64_t)s * a->table_width;
    const char *kv = (const char *)a->kv;

    /* the item's KV heads (a range within one token, else all) and its last key */
    const int tok_first = it->row_begin / a->num_heads, tok_last = (it->row_end - 1) / a->num_heads;
    const int g_lo = tok_first == tok_last ? (it->row_begin % a->num_heads) / qpk : 0;
    const int g_hi = tok_first == tok_last ? ((it->row_end - 1) % a->num_heads) / qpk : a->kv_heads - 1;
    const int nh = g_hi - g_lo + 1;
    const int64_t head_bytes = qrow ? qrow : hd * esize;
    const int64_t g_off = (int64_t)g_lo * head_bytes, g_bytes = (int64_t)nh * head_bytes;
    const int max_last = ctx + tok_last - (qrow ? 1 : 0); /* a quantized cache: own keys come first, exact */

    const int64_t block_bytes = 2 * bs * key_bytes;
    /* a quantized cache: each tile's K/V rows of the item's KV heads converted to float32 in `conv`
     * ([KEY_TILE][2][nh][hd]), which the scores and P.V read instead of the cache */
    float *conv = qrow ? pdserve_kv_scratch((int64_t)KEY_TILE * 2 * nh * hd) : NULL;
    const int g_base = qrow ? g_lo : 0;                       /* KV head of a read row's first head */
    const int64_t v_read = qrow ? (int64_t)nh * hd * 4 : v_off; /* bytes from a read K row to its V row */
    const int pv_vecs = hd / VW >= 8 && PV_VECS >= 8 ? 8 : hd / VW >= 4 ? 4 : 1; /* pv_rows' widest slice */
    const int pv_max = PV_ACCS / pv_vecs < 1 ? 1 : PV_ACCS / pv_vecs < PV_ROWS ? PV_ACCS / pv_vecs : PV_ROWS;
    key_rows(nxt, 0, max_last + 1 < KEY_TILE ? max_last + 1 : KEY_TILE, kv, table, bs, block_bytes, key_bytes);

    for (int r = 0; r < nrows; r++) {
        const int row = it->row_begin + r;
        const int tok = row / a->num_heads;
        const int head = row % a->num_heads;
        kvh[r] = head / qpk;
        const int64_t q_off = (int64_t)(q0 + tok) * a->q_token_stride + (int64_t)head * hd;
        for (int d = 0; d < hd; d++) qbuf[r * hd + d] = load1(a->q, q_off + d, bf16) * a->scale;
        for (int d = 0; d < hd; d++) acc[r * hd + d] = 0.0f;
        out_off[r] = ((int64_t)(q0 + tok) * a->num_heads + head) * hd;
        last[r] = ctx + tok;
        m[r] = -INFINITY;
        l[r] = 0.0f;
        if (qrow) { /* its own key first, exact; then the cached keys before it */
            pdserve_kv_own(a, q0 + tok, kvh[r], qbuf + r * hd, m + r, l + r, acc + r * hd);
            last[r]--;
        }
        /* insertion sort by KV head; rows come token-major, so a group's tokens (and nvis) ascend */
        int i = r;
        while (i > 0 && kvh[order[i - 1]] > kvh[r]) {
            order[i] = order[i - 1];
            i--;
        }
        order[i] = (int8_t)r;
    }
    for (int i = 0; i < nrows; i++) {
        if (i == 0 || kvh[order[i]] != kvh[order[i - 1]]) grp_begin[ngroups++] = i;
    }
    grp_begin[ngroups] = nrows;

    for (int start = 0; start <= max_last; start += KEY_TILE) {
        const int n = max_last + 1 - start < KEY_TILE ? max_last + 1 - start : KEY_TILE;
        const char **t = cur; /* the rows worked out for this tile as the next one */
        cur = nxt;
        nxt = t;
        if (qrow) {
            pdserve_kv_tile(a, table, start, n, g_lo, g_hi, conv, 2 * nh * hd, nh * hd);
            for (int j = 0; j < n; j++) cur[j] = (const char *)(conv + (int64_t)j * 2 * nh * hd);
        }
        for (int j = n; j < ((n + VW - 1) & -VW); j++) cur[j] = cur[n - 1]; /* scored, then masked */
        /* the next tile's rows (of the item's KV heads), prefetched a share of keys before each row's work:
         * spread out, in ascending order (which the hardware prefetchers follow too) */
        int nn = 0;
        if (start + KEY_TILE <= max_last) {
            nn = max_last + 1 - (start + KEY_TILE) < KEY_TILE ? max_last + 1 - (start + KEY_TILE) : KEY_TILE;
            key_rows(nxt, start + KEY_TILE, nn, kv, table, bs, block_bytes, key_bytes);
        }

        for (int gi = 0; gi < ngroups; gi++) {
            const int gb = grp_begin[gi], ge = grp_begin[gi + 1];
            const int64_t gofs = (int64_t)(kvh[order[gb]] - g_base) * hd * esize;
            for (int i = gb; i < ge; i++) {
                const int r = order[i];
                for (int j = nn * i / nrows; j < nn * (i + 1) / nrows; j++) prefetch_kv(nxt[j], g_off, g_bytes, v_off);
                int nv = last[r] + 1 - start;
                if (nv > n) nv = n;
                nvis[r] = nv;
                mnew[r] = m[r];
                if (nv > 0) {
                    const float mt = row_scores(qbuf + r * hd, (const char *const *)cur, gofs, nv, p + r * KEY_TILE,
                                                hd, bf16);
                    if (mt > m[r]) mnew[r] = mt;
                }
            }
            /* the rows' rescale factors exp(m_old - m_new), a vector of rows at a time: independent
             * chains side by side rather than a row's exp, then the next's */
            for (int i0 = gb; i0 < ge; i0 += VW) {
                const int cnt = ge - i0 < VW ? ge - i0 : VW;
                vw diff = {0};
                for (int u = 0; u < cnt; u++) diff[u] = m[order[i0 + u]] - mnew[order[i0 + u]];
                const vw e = expw(diff); /* m = -inf at first: ~1e-38 * 0 */
                for (int u = 0; u < cnt; u++) alpha[order[i0 + u]] = e[u];
            }
            for (int i = gb; i < ge; i++) {
                const int r = order[i], nv = nvis[r];
                if (nv <= 0) continue;
                float *pr = p + r * KEY_TILE;
                const float mt = mnew[r];
                vw vsum = {0};
                for (int j0 = 0; j0 < nv; j0 += VW) {
                    const iw keep = lane_ids() < nv - j0;
                    const vw e = (vw)((iw)expw(*(vw *)(pr + j0) - mt) & keep);
                    *(vw *)(pr + j0) = e;
                    vsum += e;
                }
                l[r] = l[r] * alpha[r] + hsumw(vsum);
                m[r] = mt;
            }
            /* P.V: runs of rows that see the same keys (all of a decode token's group, up to pv_max) */
            for (int i = gb; i < ge;) {
                const int nv = nvis[order[i]];
                int k = i + 1;
                while (k < ge && k - i < pv_max && nvis[order[k]] == nv) k++;
                if (nv > 0) {
                    const int8_t *rows = order + i;
                    const char *const *vr = (const char *const *)cur;
                    const int64_t voff = gofs + v_read;
                    switch (k - i) {
                    case 1: pv_rows(acc, p, rows, 1, alpha, vr, voff, nv, hd, bf16); break;
                    case 2: pv_rows(acc, p, rows, 2, alpha, vr, voff, nv, hd, bf16); break;
                    case 3: pv_rows(acc, p, rows, 3, alpha, vr, voff, nv, hd, bf16); break;
                    default: pv_rows(acc, p, rows, 4, alpha, vr, voff, nv, hd, bf16); break;
                    }
                }
                i = k;
            }
        }
    }

    for (int r = 0; r < nrows; r++) {
        const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
        for (int d = 0; d < hd; d++) store1(a->out, out_off[r] + d, acc[r * hd + d] * inv, bf16);
        if (a->m_out) {
            a->m_out[out_off[r] / hd] = m[r];
            a->l_out[out_off[r] / hd] = l[r];
        }
    }
}

static void attend_f32_64(const Args *a, const Item *it) { attend_item(a, it, 64, 0); }
static void attend_f32_128(const Args *a, const Item *it) { attend_item(a, it, 128, 0); }
static void attend_f32_any(const Args *a, const Item *it) { attend_item(a, it, a->head_dim, 0); }
static void attend_bf16_64(const Args *a, const Item *it) { attend_item(a, it, 64, 1); }
static void attend_bf16_128(const Args *a, const Item *it) { attend_item(a, it, 128, 1); }
static void attend_bf16_any(const Args *a, const Item *it) { attend_item(a, it, a->head_dim, 1); }

/* (a quantized cache takes the float32 kernels: they read its rows converted) */
attend_fn pdserve_attend_pick(const Args *a) {
    const int bf16 = a->dtype == DTYPE_BF16;
    if (a->head_dim == 64) return bf16 ? attend_bf16_64 : attend_f32_64;
    if (a->head_dim == 128) return bf16 ? attend_bf16_128 : attend_f32_128;
    return bf16 ? attend_bf16_any : attend_f32_any;
}

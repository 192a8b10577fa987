"""Triton kernels over the paged KV layout of ``kernels/attention.py``.

Three kernels (and ``kernels/triton_int4.py``'s int4 write), launched by
``kernels/triton_backend.py`` with the configurations
``kernels/triton_configs.py`` enumerates:

* ``write_kv_kernel``: one program per (new token, KV head) copies K/V into its slot.
* ``write_kv_quantized_kernel``: one program per (touched block, KV head) requantizes
  the block exactly as ``kernels/kv_quant.write_quantized`` does (keep the rows before
  the first row written, put the new rows in, zero the rest, scale = amax / qmax, codes
  rounded to nearest even), for K then V.
* ``paged_attention_kernel``: decode and chunked prefill alike. A program owns one
  *tile* (``BLOCK_M`` consecutive query rows of one sequence) and one KV head. The query
  heads sharing that KV head are folded into the rows (row ``r`` is token
  ``r // q_per_kv``, head ``r % q_per_kv``), so GQA reads each K/V once per tile. Keys
  are walked ``BLOCK_N`` positions at a time; each column finds its page through the
  block table, so any page size works and partial pages are masked, not special-cased.
  Online softmax in float32 (base 2).

Causality: a row at position ``p`` sees cache positions ``<= p``. For a quantized
cache it sees positions ``< p`` from the cache (codes x scales, or int4's
``low + code x step``, cast to the query dtype) and its own K/V unquantized from the step's
inputs, as the torch reference does.

Per-layer features (``AttentionBackend.forward``'s keywords):

* ``window`` W: a row at ``p`` sees only positions ``> p - W`` (``window`` is ``2**30`` when
  the layer has none). The key walk starts at the block holding the tile's earliest visible
  key, so blocks wholly before every row's window are skipped, and positions before it are
  masked out of the loads: pages a sliding-window cache has released are never read.
* ``SOFTCAP`` c: each score ``s = q.k * scale`` becomes ``c * tanh(s / c)`` before masking
  (``cap_in = scale / c``, ``cap_out_log2 = c * log2(e)``; tanh through ``sigmoid``, which
  the interpreter has).
* ``HAS_SINKS``: a float32 logit per query head joins the softmax denominator with no value:
  the online softmax starts from it (``m = sink``, ``l = 1``, ``acc = 0``), and a quantized
  cache's exact own key is merged into that state like any other key.

Dots run in float32 when ``DOT_FP32`` (float32 models: ``input_precision="ieee"``, so
exact like the reference instead of tf32; and every dtype under ``TRITON_INTERPRET=1``,
whose ``tl.dot`` on bfloat16 is wrong). Otherwise 16-bit operands, float32 accumulation.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.triton_codes import codes_to_float, float_to_codes
from kernels.triton_int4 import int4_tile


@triton.jit
def write_kv_kernel(
    k_ptr, v_ptr, kv_ptr, slot_ptr, block_size,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kvb, stride_kvs, stride_kvt, stride_kvh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    ok = d < HEAD_DIM
    base = (slot // block_size) * stride_kvb + (slot % block_size) * stride_kvt + h * stride_kvh + d
    k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=ok)
    v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=ok)
    tl.store(kv_ptr + base, k.to(kv_ptr.dtype.element_ty), mask=ok)
    tl.store(kv_ptr + stride_kvs + base, v.to(kv_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _requantize_side(
    src_ptr, stride_t, stride_h, kv_ptr, scale_ptr, base, h, start, end, tok0, rows, d,
    HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, QMAX: tl.constexpr,
    KV_KIND: tl.constexpr, MANT: tl.constexpr, BIAS: tl.constexpr,
):
    """One block's K (or V) rows of one head: rebuild in float32, rescale, store codes and scale."""
    ok = (rows[:, None] < PAGE) & (d[None, :] < HEAD_DIM)
    ptrs = kv_ptr + base + d[None, :]
    old = codes_to_float(tl.load(ptrs, mask=ok, other=0), KV_KIND, MANT, BIAS)
    buf = old * tl.load(scale_ptr) * (rows < start).to(tl.float32)[:, None]
    new = (rows >= start) & (rows <= end)
    fresh_ptrs = src_ptr + (tok0 + rows - start)[:, None].to(tl.int64) * stride_t + h * stride_h + d[None, :]
    fresh = tl.load(fresh_ptrs, mask=new[:, None] & ok, other=0.0).to(tl.float32)
    buf = tl.where(new[:, None], fresh, buf)
    amax = tl.max(tl.max(tl.abs(buf), axis=1), axis=0)
    scale = tl.maximum(tl.math.div_rn(amax, QMAX), 1e-12)
    y = tl.math.div_rn(buf, tl.zeros_like(buf) + scale)
    y = tl.minimum(tl.maximum(y, -QMAX), QMAX)
    tl.store(ptrs, float_to_codes(y, KV_KIND, MANT, BIAS), mask=ok)
    tl.store(scale_ptr, scale)


@triton.jit
def write_kv_quantized_kernel(
    k_ptr, v_ptr, kv_ptr, scales_ptr, blk_ptr, start_ptr, end_ptr, tok_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kvb, stride_kvs, stride_kvt, stride_kvh, stride_sb, stride_ss,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr, BLOCK_T: tl.constexpr,
    QMAX: tl.constexpr, KV_KIND: tl.constexpr, MANT: tl.constexpr, BIAS: tl.constexpr,
):
    u = tl.program_id(0)
    h = tl.program_id(1)
    blk = tl.load(blk_ptr + u).to(tl.int64)
    start = tl.load(start_ptr + u)
    end = tl.load(end_ptr + u)
    tok0 = tl.load(tok_ptr + u)
    rows = tl.arange(0, BLOCK_T)
    d = tl.arange(0, BLOCK_D)
    base = blk * stride_kvb + rows[:, None].to(tl.int64) * stride_kvt + h * stride_kvh
    scale_ptr = scales_ptr + blk * stride_sb + h
    _requantize_side(k_ptr, stride_kt, stride_kh, kv_ptr, scale_ptr, base, h, start, end, tok0, rows, d,
                     HEAD_DIM, PAGE, QMAX, KV_KIND, MANT, BIAS)
    _requantize_side(v_ptr, stride_vt, stride_vh, kv_ptr, scale_ptr + stride_ss, base + stride_kvs, h,
                     start, end, tok0, rows, d, HEAD_DIM, PAGE, QMAX, KV_KIND, MANT, BIAS)


@triton.jit
def _dot(a, b, DOT_FP32: tl.constexpr):
    if DOT_FP32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def paged_attention_kernel(
    q_ptr, k_ptr, v_ptr, kv_ptr, scales_ptr, out_ptr, sinks_ptr,
    tables_ptr, qstart_ptr, seqlen_ptr, tile_seq_ptr, tile_row_ptr,
    sm_scale_log2, cap_in, cap_out_log2, window, q_per_kv, block_size,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh, stride_tab,
    stride_kvb, stride_kvs, stride_kvt, stride_kvh, stride_sb, stride_ss,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    KV_KIND: tl.constexpr, MANT: tl.constexpr, BIAS: tl.constexpr, DOT_FP32: tl.constexpr,
    HAS_SINKS: tl.constexpr, SOFTCAP: tl.constexpr, GROUP: tl.constexpr,
):
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    seq = tl.load(tile_seq_ptr + tile)
    row0 = tl.load(tile_row_ptr + tile)
    q_begin = tl.load(qstart_ptr + seq)
    q_len = tl.load(qstart_ptr + seq + 1) - q_begin
    seq_len = tl.load(seqlen_ptr + seq)
    rows = row0 + tl.arange(0, BLOCK_M)
    tok = rows // q_per_kv
    head = kvh * q_per_kv + rows % q_per_kv
    row_ok = tok < q_len
    qpos = seq_len - q_len + tok
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    tok_idx = (q_begin + tok).to(tl.int64)
    qk_mask = row_ok[:, None] & d_ok[None, :]
    q = tl.load(q_ptr + tok_idx[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=qk_mask, other=0.0)
    q_dtype = q_ptr.dtype.element_ty
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    if HAS_SINKS:  # a logit per head in the denominator with no value: the softmax starts from it
        m_i = tl.load(sinks_ptr + head, mask=row_ok, other=0.0) * 1.4426950408889634
        l_i = tl.full([BLOCK_M], 1.0, tl.float32)
    if KV_KIND != 0:  # own K/V, exact: the first key of every row
        k_own = tl.load(k_ptr + tok_idx[:, None] * stride_kt + kvh * stride_kh + d[None, :],
                        mask=qk_mask, other=0.0).to(q_dtype).to(tl.float32)
        v_own = tl.load(v_ptr + tok_idx[:, None] * stride_vt + kvh * stride_vh + d[None, :],
                        mask=qk_mask, other=0.0).to(q_dtype).to(tl.float32)
        s_own = tl.sum(q.to(tl.float32) * k_own, axis=1)
        if SOFTCAP:  # c * tanh(s / c), tanh(z) = 2 sigmoid(2z) - 1
            s_own = cap_out_log2 * (2.0 * tl.sigmoid(2.0 * cap_in * s_own) - 1.0)
        else:
            s_own = s_own * sm_scale_log2
        m_own = tl.maximum(m_i, s_own)
        p_own = tl.exp2(s_own - m_own)
        l_i = l_i * tl.exp2(m_i - m_own) + p_own
        acc = v_own * p_own[:, None]
        m_i = m_own
    last_tok = tl.minimum((row0 + BLOCK_M - 1) // q_per_kv, q_len - 1)
    hi = seq_len - q_len + last_tok + 1
    limit = qpos + 1  # a row sees cache positions < limit
    if KV_KIND != 0:
        hi = hi - 1
        limit = qpos
    # ... and >= first (its window): first <= pos < limit as one unsigned compare of pos - first
    first = qpos - window + 1
    span = (limit - first).to(tl.uint32)
    lo = tl.maximum(seq_len - q_len + row0 // q_per_kv - window + 1, 0)  # the tile's earliest key
    for start in range((lo // BLOCK_N) * BLOCK_N, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        pos_ok = (pos >= lo) & (pos < hi)  # keys no row sees are never read (nor their pages looked up)
        page = tl.load(tables_ptr + seq * stride_tab + pos // block_size, mask=pos_ok, other=0).to(tl.int64)
        base = page * stride_kvb + (pos % block_size).to(tl.int64) * stride_kvt + kvh * stride_kvh
        kv_mask = pos_ok[:, None] & d_ok[None, :]
        if KV_KIND == 3:  # int4: two codes a byte, (low, step) per group (kernels/triton_int4.py)
            k = int4_tile(kv_ptr, scales_ptr, base, page, kvh, d, kv_mask, stride_sb, HEAD_DIM, GROUP)
            v = int4_tile(kv_ptr + stride_kvs, scales_ptr + stride_ss, base, page, kvh, d, kv_mask, stride_sb,
                          HEAD_DIM, GROUP)
            k = k.to(q_dtype)
            v = v.to(q_dtype)
        else:
            k = tl.load(kv_ptr + base[:, None] + d[None, :], mask=kv_mask, other=0)
            v = tl.load(kv_ptr + stride_kvs + base[:, None] + d[None, :], mask=kv_mask, other=0)
            if KV_KIND != 0:
                k_scale = tl.load(scales_ptr + page * stride_sb + kvh, mask=pos_ok, other=0.0)
                v_scale = tl.load(scales_ptr + page * stride_sb + stride_ss + kvh, mask=pos_ok, other=0.0)
                k = (codes_to_float(k, KV_KIND, MANT, BIAS) * k_scale[:, None]).to(q_dtype)
                v = (codes_to_float(v, KV_KIND, MANT, BIAS) * v_scale[:, None]).to(q_dtype)
        s = _dot(q, tl.trans(k), DOT_FP32)
        s = cap_out_log2 * (2.0 * tl.sigmoid(2.0 * cap_in * s) - 1.0) if SOFTCAP else s * sm_scale_log2
        visible = (pos[None, :] - first[:, None]).to(tl.uint32) < span[:, None]
        s = tl.where(visible & pos_ok[None, :] & row_ok[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_FP32)
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + tok_idx[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=qk_mask)

"""Triton pieces of the int4 KV cache (``kernels/kv_int4.py``): reading a tile of codes, and the write.

* ``int4_tile``: the float32 values of ``[keys, channels]`` of one KV head: each channel's byte (``d // 2``)
  shifted by ``4 * (d % 2)``, times its group's ``step`` plus its ``low`` (a multiply then an add, as
  the torch reference does; no fused multiply-add is asked for).
* ``write_kv_int4_kernel``: one program per (touched block, KV head) requantizes the block exactly as
  ``kv_int4.write_rows`` does, K then V: the rows before the first row written are dequantized and
  kept, the new rows put in, each group's ``low``/``step`` recomputed as the minimum and
  ``(max - min) / 15`` over the valid rows (up to the last written), codes ``(x - low) / step``
  rounded to nearest even and clamped to ``0..15``, stale rows code 0. A program holds the block as
  two tiles, even and odd channels (``[rows, head_dim / 2]`` each), so a byte's two codes are packed
  without reshaping.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.triton_codes import rint


@triton.jit
def int4_tile(kv_ptr, params_ptr, base, page, kvh, d, mask, stride_pb,
              HEAD_DIM: tl.constexpr, GROUP: tl.constexpr):
    """Values ``[N, BLOCK_D]`` of the rows at ``base`` (``[N]`` byte offsets), pages ``page`` (``[N]``)."""
    byte = tl.load(kv_ptr + base[:, None] + (d // 2)[None, :], mask=mask, other=0).to(tl.int32)
    code = (byte >> ((d % 2) * 4)[None, :]) & 15
    head = kvh * (2 * (HEAD_DIM // GROUP))
    prm = params_ptr + page[:, None] * stride_pb + head + ((d // GROUP) * 2)[None, :]
    low = tl.load(prm, mask=mask, other=0.0)
    step = tl.load(prm + 1, mask=mask, other=0.0)
    return code.to(tl.float32) * step + low


@triton.jit
def _int4_side(src_ptr, stride_t, stride_h, kv_ptr, prm_ptr, base, h, start, end, tok0, rows, j,
               HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, GROUP: tl.constexpr):
    """One block's K (or V) rows of one head: rebuild in float32, new ``(low, step)`` per group, codes."""
    j_ok = j < HEAD_DIM // 2
    ok = (rows[:, None] < PAGE) & j_ok[None, :]
    ptrs = kv_ptr + base + j[None, :]
    byte = tl.load(ptrs, mask=ok, other=0).to(tl.int32)
    g = (2 * j) // GROUP
    low_old = tl.load(prm_ptr + g * 2, mask=j_ok, other=0.0)[None, :]
    step_old = tl.load(prm_ptr + g * 2 + 1, mask=j_ok, other=0.0)[None, :]
    keep = (rows < start).to(tl.float32)[:, None]
    even = ((byte & 15).to(tl.float32) * step_old + low_old) * keep
    odd = ((byte >> 4).to(tl.float32) * step_old + low_old) * keep
    new = (rows >= start) & (rows <= end)
    fresh = src_ptr + (tok0 + rows - start)[:, None].to(tl.int64) * stride_t + h * stride_h
    fresh_ok = new[:, None] & ok
    fresh_even = tl.load(fresh + (2 * j)[None, :], mask=fresh_ok, other=0.0).to(tl.float32)
    fresh_odd = tl.load(fresh + (2 * j + 1)[None, :], mask=fresh_ok, other=0.0).to(tl.float32)
    even = tl.where(new[:, None], fresh_even, even)
    odd = tl.where(new[:, None], fresh_odd, odd)
    valid = (rows <= end)[:, None] & ok
    low = tl.zeros_like(low_old)
    step = tl.zeros_like(step_old)
    for gi in tl.static_range(HEAD_DIM // GROUP):
        in_g = valid & (g == gi)[None, :]
        lo = tl.minimum(tl.min(tl.min(tl.where(in_g, even, float("inf")), axis=1), axis=0),
                        tl.min(tl.min(tl.where(in_g, odd, float("inf")), axis=1), axis=0))
        hi = tl.maximum(tl.max(tl.max(tl.where(in_g, even, float("-inf")), axis=1), axis=0),
                        tl.max(tl.max(tl.where(in_g, odd, float("-inf")), axis=1), axis=0))
        st = tl.maximum(tl.math.div_rn(hi - lo, 15.0), 1e-12)
        low = tl.where((g == gi)[None, :], lo, low)
        step = tl.where((g == gi)[None, :], st, step)
        tl.store(prm_ptr + gi * 2, lo)
        tl.store(prm_ptr + gi * 2 + 1, st)
    c_even = tl.minimum(tl.maximum(rint(tl.math.div_rn(even - low, step)), 0.0), 15.0)
    c_odd = tl.minimum(tl.maximum(rint(tl.math.div_rn(odd - low, step)), 0.0), 15.0)
    packed = tl.where(valid, c_even.to(tl.int32) | (c_odd.to(tl.int32) << 4), 0)
    tl.store(ptrs, packed.to(tl.uint8), mask=ok)


@triton.jit
def write_kv_int4_kernel(
    k_ptr, v_ptr, kv_ptr, params_ptr, blk_ptr, start_ptr, end_ptr, tok_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kvb, stride_kvs, stride_kvt, stride_kvh, stride_pb, stride_ps,
    HEAD_DIM: tl.constexpr, BLOCK_J: tl.constexpr, PAGE: tl.constexpr, BLOCK_T: tl.constexpr,
    GROUP: tl.constexpr,
):
    u = tl.program_id(0)
    h = tl.program_id(1)
    blk = tl.load(blk_ptr + u).to(tl.int64)
    start = tl.load(start_ptr + u)
    end = tl.load(end_ptr + u)
    tok0 = tl.load(tok_ptr + u)
    rows = tl.arange(0, BLOCK_T)
    j = tl.arange(0, BLOCK_J)
    base = blk * stride_kvb + rows[:, None].to(tl.int64) * stride_kvt + h * stride_kvh
    prm = params_ptr + blk * stride_pb + h * (2 * (HEAD_DIM // GROUP))
    _int4_side(k_ptr, stride_kt, stride_kh, kv_ptr, prm, base, h, start, end, tok0, rows, j,
               HEAD_DIM, PAGE, GROUP)
    _int4_side(v_ptr, stride_vt, stride_vh, kv_ptr, prm + stride_ps, base + stride_kvs, h, start, end, tok0,
               rows, j, HEAD_DIM, PAGE, GROUP)

"""Triton kernel for latent attention's absorbed decode form over the paged latent cache.

``kernels/mla.py`` has the math and the cache layout; ``kernels/mla_backends.MlaTritonBackend``
launches it with ``kernels/triton_configs.mla_launch``'s configuration.

``mla_decode_kernel``: one program per (decode sequence, ``BLOCK_H`` query heads). The heads' absorbed
queries (``w_uk`` folded into ``q_nope``, then ``q_rope``: ``RANK + ROPE`` values each) are loaded once;
the sequence's keys are walked ``BLOCK_N`` positions at a time, each column finding its row through the
block table (any page size, partial pages masked). Each cached row is read once for all ``BLOCK_H``
heads: the latent part ``[BLOCK_N, RANK]`` serves both the scores (``q_lat . c``) and the values
(``p @ c``), the rotary part ``[BLOCK_N, ROPE]`` the scores only, so a step reads 576 values per token
for DeepSeek's shapes whatever the head count. Online softmax in float32 (base 2); the output is each
head's mix of latents ``[RANK]`` in float32, to which ``w_uv`` is applied outside.

A quantized cache (``KV_KIND`` int8 or fp8 codes as bytes, ``kernels/triton_codes.py``) is dequantized
with its block's scale (one per block) as it is loaded, exactly as the torch reference reads it. Dots
run in float32 when ``DOT_FP32`` (float32 models, and the interpreter: the probabilities stay float32
too); else the queries, the dequantized rows and the probabilities are 16-bit and the dots accumulate
in float32.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.triton_attention import _dot
from kernels.triton_codes import codes_to_float


@triton.jit
def mla_decode_kernel(
    q_ptr, out_ptr, cache_ptr, scales_ptr, tables_ptr, lens_ptr,
    sm_scale_log2, heads, block_size,
    stride_qs, stride_qh, stride_os, stride_oh, stride_tab, stride_row,
    RANK: tl.constexpr, ROPE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    KV_KIND: tl.constexpr, MANT: tl.constexpr, BIAS: tl.constexpr, DOT_FP32: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = head < heads
    r = tl.arange(0, BLOCK_R)
    p = tl.arange(0, BLOCK_P)
    r_ok = r < RANK
    p_ok = p < ROPE
    q_row = q_ptr + seq.to(tl.int64) * stride_qs + head[:, None] * stride_qh
    q_lat = tl.load(q_row + r[None, :], mask=h_ok[:, None] & r_ok[None, :], other=0.0)
    q_rope = tl.load(q_row + RANK + p[None, :], mask=h_ok[:, None] & p_ok[None, :], other=0.0)
    q_dtype = q_ptr.dtype.element_ty
    seq_len = tl.load(lens_ptr + seq)
    m_i = tl.full([BLOCK_H], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_R], tl.float32)
    for start in range(0, seq_len, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        pos_ok = pos < seq_len
        page = tl.load(tables_ptr + seq * stride_tab + pos // block_size, mask=pos_ok, other=0).to(tl.int64)
        row = cache_ptr + (page * block_size + (pos % block_size).to(tl.int64))[:, None] * stride_row
        lat = tl.load(row + r[None, :], mask=pos_ok[:, None] & r_ok[None, :], other=0)
        k_rope = tl.load(row + RANK + p[None, :], mask=pos_ok[:, None] & p_ok[None, :], other=0)
        if KV_KIND != 0:
            scale = tl.load(scales_ptr + page, mask=pos_ok, other=0.0)[:, None]
            lat = (codes_to_float(lat, KV_KIND, MANT, BIAS) * scale).to(q_dtype)
            k_rope = (codes_to_float(k_rope, KV_KIND, MANT, BIAS) * scale).to(q_dtype)
        s = _dot(q_lat, tl.trans(lat), DOT_FP32) + _dot(q_rope, tl.trans(k_rope), DOT_FP32)
        s = tl.where(pos_ok[None, :], s * sm_scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        prob = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(prob, axis=1)
        if not DOT_FP32:
            prob = prob.to(lat.dtype)
        acc = acc * alpha[:, None] + _dot(prob, lat, DOT_FP32)
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + seq.to(tl.int64) * stride_os + head[:, None] * stride_oh + r[None, :], out,
             mask=h_ok[:, None] & r_ok[None, :])

"""The product over a matrix kept in its quantized blocks, in Triton: quantized weights on GPUs.

``triton_block_linear(x, rows, kind, out_features, bias)`` computes ``x @ W.T + bias`` where ``W`` is
a ``kernels.gguf_blocks.BlockMatrix``'s ``rows`` (uint8 ``[out, in / block inputs * block bytes]``) of
one of ``TRITON_KINDS``: an fp8 checkpoint's ``FP8`` records (a float32 scale and 32 e4m3 codes), MXFP4
experts as ``Q5_0`` records (``engine/checkpoint_quant.mxfp4_stack``), a GGUF's Q4_0, Q4_1, Q5_0, Q5_1,
Q8_0 matrices and its K formats' super-blocks of 256 inputs (Q4_K, Q5_K, Q6_K), and ``KMIX`` rows (a
fused matrix of mixed kinds, ``kernels/kmix.py``). Nothing is dequantized in memory: the weights stay
the bytes they were loaded as (a byte and an eighth a weight for fp8, 5.5 bits for MXFP4 and Q5_0, 4.5
for Q4_0 and Q4_K, 6.56 for Q6_K).

One program computes a ``BLOCK_M x BLOCK_N`` tile of ``y``. It walks the inputs 32 at a time (one record,
or one sub-block of a K super-block): it loads those inputs' codes for its ``BLOCK_N`` output rows,
decodes them with integer operations to the *unscaled* values (``q - 8`` for Q4_0, ``q`` for Q4_1 and
Q4_K, ``q - 32`` for Q6_K, the e4m3 value for FP8), takes the dot with the 32 columns of ``x``, and adds
that times each row's scale (a K sub-block's ``d * sc``) to a float32 accumulator, plus the minimum times
the sum of ``x``'s 32 values for Q4_1, Q5_1, Q4_K, Q5_K and KMIX. Q6_K and KMIX scale each 16 inputs
apart, so they take a dot per half. Every unscaled value is exact in bfloat16 and float16 (at most 8
significant bits), so a 16-bit dot loses nothing the float32 dequantized weight has; only the sums' order
differs from ``F.linear`` over ``BlockMatrix.dequantize()``. The decode uses no
fp8 type (Triton's e4m3 casts need sm_89; sm_80 has none) and reads every multi-byte field byte by byte,
so records of any length and alignment load alike on every target and under the interpreter.

Dots run in float32 (``input_precision="ieee"``) for float32 activations and under the interpreter
(whose 16-bit ``tl.dot`` is wrong), as in ``kernels/triton_moe.py``. Tiles and warps:
``kernels.triton_configs.block_linear_launch``, compiled spill-free for sm_80 and sm_90 by
``kernels/triton_aot.py``.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kernels.gguf_blocks import BLOCK_BYTES, BLOCK_INPUTS, BlockKind
from kernels.triton_configs import DECODE_ROWS, TRITON_KINDS, KernelLaunch, block_linear_launch, interpreting


@triton.jit
def _byte(ptr):
    return tl.load(ptr).to(tl.int32)


@triton.jit
def _f16(ptr):
    """The little-endian float16 at ``ptr`` (byte pointers), as float32."""
    bits = (_byte(ptr) | (_byte(ptr + 1) << 8)).to(tl.uint16)
    return bits.to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _f32(ptr):
    """The little-endian float32 at ``ptr`` (byte pointers)."""
    bits = _byte(ptr) | (_byte(ptr + 1) << 8) | (_byte(ptr + 2) << 16) | (_byte(ptr + 3) << 24)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _e4m3(code):
    """e4m3fn byte codes (int32) -> their float32 values (no NaN: the loader refuses NaN codes)."""
    exp = (code >> 3) & 15
    man = code & 7
    normal = (((exp + 120) << 23) | (man << 20)).to(tl.float32, bitcast=True)
    value = tl.where(exp == 0, man.to(tl.float32) * 0.001953125, normal)  # subnormal: man / 8 * 2**-6
    return tl.where((code & 128) != 0, -value, value)


@triton.jit
def _nibble(rec, e, start):
    """Element ``e``'s 4-bit code of a 32-input record whose codes begin at byte ``start``: the low nibble
    of byte ``e`` for ``e < 16``, the high nibble of byte ``e - 16`` above."""
    byte = _byte(rec + start + (e % 16))
    return (byte >> ((e // 16) * 4)) & 15


@triton.jit
def _fifth(rec, e, start):
    """Element ``e``'s fifth bit: bit ``e`` of the little-endian word at byte ``start``."""
    return ((_byte(rec + start + e // 8) >> (e % 8)) & 1) << 4


@triton.jit
def block_linear_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_ym, row_bytes,
    KIND: tl.constexpr, REC: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_FP32: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    e = tl.arange(0, 32)
    # the records of this tile's rows, [32, BLOCK_N] once broadcast against the element index
    row_ptr = w_ptr + tl.where(mask_n, offs_n, 0).to(tl.int64) * row_bytes
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for j in range(0, K // 32):
        rec = row_ptr + j * REC  # [BLOCK_N]: a 32-input kind's record of block j
        sup = row_ptr + (j // 8) * REC  # a K kind's super-block of 256 inputs, and j's sub-block in it
        sub = j % 8
        if KIND == 6 or KIND == 7:  # Q6_K, KMIX: a scale per 16 inputs, so a dot per half
            h = tl.arange(0, 16)
            x_lo = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + (j * 32 + h)[None, :],
                           mask=mask_m[:, None], other=0.0)
            x_hi = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + (j * 32 + 16 + h)[None, :],
                           mask=mask_m[:, None], other=0.0)
            lo, hi = h[:, None], 16 + h[:, None]
            if KIND == 6:  # Q6_K: 128 low nibbles, 64 bytes of bit pairs, 16 int8 scales, d
                half, g = sub // 4, sub % 4
                d = _f16(sup + 208)
                d_lo = d * _byte(sup + 192 + 2 * sub).to(tl.int8).to(tl.float32)
                d_hi = d * _byte(sup + 193 + 2 * sub).to(tl.int8).to(tl.float32)
                low = sup[None, :] + half * 64 + (g % 2) * 32
                high = sup[None, :] + 128 + half * 32
                q_lo = ((((_byte(low + lo) >> ((g // 2) * 4)) & 15)
                         | (((_byte(high + lo) >> (2 * g)) & 3) << 4)) - 32).to(tl.float32)
                q_hi = ((((_byte(low + hi) >> ((g // 2) * 4)) & 15)
                         | (((_byte(high + hi) >> (2 * g)) & 3) << 4)) - 32).to(tl.float32)
            else:  # KMIX: float32 scales of each half and a minimum, 32 codes 0..63
                d_lo, d_hi = _f32(rec), _f32(rec + 4)
                q_lo = (_byte(rec[None, :] + 12 + lo) - 32).to(tl.float32)
                q_hi = (_byte(rec[None, :] + 12 + hi) - 32).to(tl.float32)
            if DOT_FP32:
                x_lo, x_hi = x_lo.to(tl.float32), x_hi.to(tl.float32)
                acc += tl.dot(x_lo, q_lo, input_precision="ieee") * d_lo[None, :]
                acc += tl.dot(x_hi, q_hi, input_precision="ieee") * d_hi[None, :]
            else:
                acc += tl.dot(x_lo, q_lo.to(x_lo.dtype)) * d_lo[None, :]
                acc += tl.dot(x_hi, q_hi.to(x_hi.dtype)) * d_hi[None, :]
            if KIND == 7:
                both = tl.sum(x_lo.to(tl.float32), axis=1) + tl.sum(x_hi.to(tl.float32), axis=1)
                acc += both[:, None] * _f32(rec + 8)[None, :]
        else:
            x = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + (j * 32 + e)[None, :],
                        mask=mask_m[:, None], other=0.0)
            recs = rec[None, :]
            ee = e[:, None]
            m_part = tl.zeros((BLOCK_N,), dtype=tl.float32)
            if KIND == 8:  # FP8: float32 scale, 32 e4m3 codes
                d = _f32(rec)
                q = _e4m3(_byte(recs + 4 + ee))
            elif KIND == 3:  # Q8_0: float16 d, 32 signed codes
                d = _f16(rec)
                q = _byte(recs + 2 + ee).to(tl.int8).to(tl.float32)
            elif KIND == 1:  # Q4_0: d, nibbles; d * (q - 8)
                d = _f16(rec)
                q = (_nibble(recs, ee, 2) - 8).to(tl.float32)
            elif KIND == 2:  # Q4_1: d, m, nibbles; d * q + m
                d = _f16(rec)
                m_part = _f16(rec + 2)
                q = _nibble(recs, ee, 4).to(tl.float32)
            elif KIND == 9:  # Q5_0: d, fifth bits, nibbles; d * (q - 16)
                d = _f16(rec)
                q = ((_nibble(recs, ee, 6) | _fifth(recs, ee, 2)) - 16).to(tl.float32)
            elif KIND == 10:  # Q5_1: d, m, fifth bits, nibbles; d * q + m
                d = _f16(rec)
                m_part = _f16(rec + 2)
                q = (_nibble(recs, ee, 8) | _fifth(recs, ee, 4)).to(tl.float32)
            else:  # Q4_K, Q5_K: d, dmin, 6-bit scales and mins of 8 sub-blocks, (fifth bits), nibbles
                lo4 = _byte(sup + 4 + sub % 4)
                hi4 = _byte(sup + 8 + sub % 4)
                mix = _byte(sup + 12 + sub % 4)
                sc = tl.where(sub < 4, lo4 & 63, (mix & 15) | ((lo4 >> 6) << 4))
                mn = tl.where(sub < 4, hi4 & 63, (mix >> 4) | ((hi4 >> 6) << 4))
                d = _f16(sup) * sc.to(tl.float32)
                m_part = -(_f16(sup + 2) * mn.to(tl.float32))
                start = 48 if KIND == 11 else 16
                q = (_byte(sup[None, :] + start + (sub // 2) * 32 + ee) >> ((sub % 2) * 4)) & 15
                if KIND == 11:
                    q = q | (((_byte(sup[None, :] + 16 + ee) >> sub) & 1) << 4)
                q = q.to(tl.float32)
            if DOT_FP32:
                x = x.to(tl.float32)
                acc += tl.dot(x, q, input_precision="ieee") * d[None, :]
            else:
                acc += tl.dot(x, q.to(x.dtype)) * d[None, :]
            if KIND == 2 or KIND == 10 or KIND == 5 or KIND == 11:
                acc += tl.sum(x.to(tl.float32), axis=1)[:, None] * m_part[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :],
             acc.to(y_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@functools.cache
def _launch(dtype: torch.dtype, kind: BlockKind, decode: bool, has_bias: bool,
            interpret: bool) -> KernelLaunch:
    """``block_linear_launch``'s answer, built once per distinct call (every product of a step asks)."""
    return block_linear_launch(dtype, kind, 1 if decode else DECODE_ROWS + 1, has_bias, interpret)


def triton_block_linear(x: torch.Tensor, rows: torch.Tensor, kind: BlockKind, out_features: int,
                        bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T + bias`` for ``W`` in ``rows`` of ``kind`` (module docstring); ``x`` is ``[..., in]``
    in float32, bfloat16 or float16, the result ``[..., out]`` in ``x``'s dtype."""
    if kind not in TRITON_KINDS:
        raise ValueError(f"the Triton block product reads {', '.join(k.name for k in TRITON_KINDS)}, "
                         f"not {kind.name}")
    in_features = x.shape[-1]
    per_row = in_features // BLOCK_INPUTS[kind] * BLOCK_BYTES[kind]
    if (in_features % BLOCK_INPUTS[kind] or rows.dtype != torch.uint8
            or tuple(rows.shape) != (out_features, per_row)):
        raise ValueError(f"{kind.name} rows {tuple(rows.shape)} {rows.dtype} do not hold a "
                         f"[{out_features}, {in_features}] matrix")
    flat = x.reshape(-1, in_features).contiguous()
    m = flat.shape[0]
    y = torch.empty(m, out_features, dtype=x.dtype, device=x.device)
    if m:
        cfg = _launch(x.dtype, kind, m <= DECODE_ROWS, bias is not None, interpreting())
        grid = (triton.cdiv(m, int(cfg.constexprs["BLOCK_M"])),
                triton.cdiv(out_features, int(cfg.constexprs["BLOCK_N"])))
        block_linear_kernel[grid](
            flat, rows, bias if bias is not None else flat, y, m, out_features, in_features,
            flat.stride(0), y.stride(0), per_row, num_warps=cfg.num_warps, **cfg.constexprs,
        )
    return y.view(*x.shape[:-1], out_features)

"""Triton helpers for quantized KV codes: fp8 (e4m3fn / e5m2) and int8 <-> float32, by bits.

fp8 codes are read and written as ``uint8`` with integer arithmetic, never through
Triton's fp8 types: the same code compiles for sm_80 (which has no e4m3 conversion),
sm_90 and the interpreter, and it rounds exactly like torch's ``float32 -> float8``
cast (round to nearest, ties to even; inputs are clamped to the finite range first,
as ``kernels/kv_quant.py`` does). ``MANT``/``BIAS`` select the format: e4m3fn is
(3, 7), e5m2 is (2, 15). NaN and infinity codes are never produced, so they are not
decoded specially.
"""

from __future__ import annotations

import triton
import triton.language as tl

# KV_KIND constexpr of the kernels: how the cache stores values
KIND_PLAIN = 0  # the cache dtype is a float dtype, read as is
KIND_INT8 = 1
KIND_FP8 = 2  # uint8 view of an fp8 cache; MANT/BIAS give the format
KIND_INT4 = 3  # uint8 bytes of two codes, (low, step) per group of GROUP channels (kernels/triton_int4.py)


@triton.jit
def exp2i(n):
    """``2.0 ** n`` as float32 for an int32 tensor ``n`` in the normal range, exactly."""
    return ((n + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def rint(z):
    """Round float32 ``z`` to the nearest integer, ties to even (``torch.round``)."""
    fl = tl.floor(z)
    diff = z - fl
    odd = (fl - 2.0 * tl.floor(fl * 0.5)) == 1.0
    up = (diff > 0.5) | ((diff == 0.5) & odd)
    return fl + up.to(tl.float32)


@triton.jit
def fp8_to_float(c, MANT: tl.constexpr, BIAS: tl.constexpr):
    """uint8 fp8 codes -> float32."""
    b = c.to(tl.int32) & 0xFF
    e = (b >> MANT) & ((1 << (7 - MANT)) - 1)
    m = b & ((1 << MANT) - 1)
    sig = m + tl.where(e > 0, 1 << MANT, 0)
    val = sig.to(tl.float32) * exp2i(tl.maximum(e, 1) - BIAS - MANT)
    return tl.where((b >> 7) == 1, -val, val)


@triton.jit
def float_to_fp8(y, MANT: tl.constexpr, BIAS: tl.constexpr):
    """float32 ``y`` (already clamped to the format's range) -> uint8 fp8 codes, ties to even.

    With ``e_eff = max(exponent, 1 - BIAS)`` and ``r`` the significand rounded on the
    grid ``2 ** (e_eff - MANT)``, the code is ``(e_eff + BIAS - 1) * 2 ** MANT + r``: this
    covers subnormals and a rounding carry into the next exponent alike.
    """
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 31) & 1
    a = tl.abs(y)
    e = ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    e_eff = tl.maximum(e, 1 - BIAS)
    r = rint(a * exp2i(MANT - e_eff))
    code = (e_eff + BIAS - 1) * (1 << MANT) + r.to(tl.int32)
    return (code | (sign << 7)).to(tl.uint8)


@triton.jit
def codes_to_float(c, KV_KIND: tl.constexpr, MANT: tl.constexpr, BIAS: tl.constexpr):
    """Stored values as float32 (a plain cache is only upcast)."""
    if KV_KIND == 2:
        return fp8_to_float(c, MANT, BIAS)
    else:
        return c.to(tl.float32)


@triton.jit
def float_to_codes(y, KV_KIND: tl.constexpr, MANT: tl.constexpr, BIAS: tl.constexpr):
    """Clamped float32 ``y`` -> stored codes (int8 rounds ties to even first)."""
    if KV_KIND == 2:
        return float_to_fp8(y, MANT, BIAS)
    else:
        return rint(y).to(tl.int8)

"""Quantized KV cache: fp8 (e4m3 / e5m2) or int8 blocks with float32 scales beside them.

(int4, two codes a byte with a range per group of channels: ``kernels/kv_int4.py``.)

Storage
-------
The KV tensor keeps its layout ``[layers, blocks, parts, block_size, kv_heads, head_dim]``
(parts: K and V, or latent attention's one latent row) but holds ``torch.float8_e4m3fn``,
``torch.float8_e5m2`` or ``torch.int8``. Beside it lives one scales tensor
``[layers, blocks, parts, kv_heads]`` float32: one scale per block, per part, per KV
head (a latent cache: one per block). A stored value ``q`` means ``q * scale``.

Scale scheme (per block, per head, grown with requantization)
-------------------------------------------------------------
A block's scale must cover every token written to it, and decode appends tokens to
partially filled blocks one at a time. On every write the touched blocks are
dequantized with their current scales, the new tokens are put in, and each block's
scale is recomputed as ``amax / qmax`` over the block's *valid* rows: the rows
before the first row written in this step (earlier tokens of the same sequence)
and the rows written now. Rows after the last written row are stale (a reused
block) and are zeroed. So:

* a block written from row 0 starts afresh (a reused block never inherits an old,
  too large scale);
* otherwise the scale only grows: the earlier tokens' dequantized maximum is
  exactly ``old_scale * qmax``, so the new scale is at least the old one, and when
  it is unchanged the earlier tokens requantize to exactly the same codes;
* when it grows, the block's earlier tokens are requantized once under the new
  scale (one more rounding for them, never an overflow).

Every write is deterministic, so the same sequence of writes (same chunking) yields
the same bytes on any worker: a disaggregated prefill and a colocated one agree.

Attention reads gather the quantized rows and dequantize them with the gathered
scales (``kernels/torch_ref.py``); the native CPU kernels write the same bytes and read
the codes in place, a tile at a time converted to the same float32 values
(``kernels/cpu_kv_codes.c``); the Triton kernels dequantize as they load.
"""

from __future__ import annotations

import functools

import torch

from kernels import kv_int4
from kernels.block_writes import touched_blocks

KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {
    "auto": None,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
    "int8": torch.int8,
    "int4": kv_int4.STORAGE_DTYPE,  # two codes a byte, with (low, step) per group: kernels/kv_int4.py
}
SCALED_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2, torch.int8)  # one scale per block, part, head
QUANTIZED_DTYPES = (*SCALED_DTYPES, kv_int4.STORAGE_DTYPE)
SCALE_DTYPE = torch.float32
_MIN_SCALE = 1e-12


def parse_kv_cache_dtype(name: str) -> torch.dtype | None:
    """``None`` for ``auto`` (the model dtype), else the storage dtype; ValueError names the flag."""
    try:
        return KV_CACHE_DTYPES[name.lower()]
    except KeyError:
        raise ValueError(
            f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {name!r}"
        ) from None


def is_quantized(dtype: torch.dtype) -> bool:
    return dtype in QUANTIZED_DTYPES


def stored_head_dim(dtype: torch.dtype, head_dim: int) -> int:
    """Elements of ``dtype`` one head's row takes in the cache (int4: two channels a byte)."""
    return head_dim // 2 if kv_int4.is_int4(dtype) else head_dim


def scale_shape(dtype: torch.dtype, head_dim: int) -> tuple[int, ...]:
    """The scales tensor's dimensions after ``[layers, blocks, parts, kv_heads]``: none for fp8/int8 (one
    scale), ``(groups, 2)`` for int4 (``kernels/kv_int4.py``)."""
    return (kv_int4.num_groups(head_dim), 2) if kv_int4.is_int4(dtype) else ()


def qmax(dtype: torch.dtype) -> float:
    """Largest magnitude a stored code represents."""
    if dtype == torch.int8:
        return 127.0
    return float(torch.finfo(dtype).max)


def quantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x / scale`` as ``dtype`` codes (``scale`` broadcasts), clamped to the representable range."""
    limit = qmax(dtype)
    y = (x / scale).clamp_(-limit, limit)
    if dtype == torch.int8:
        y = y.round_()
    return y.to(dtype)


_LUTS: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def codes_to_float(q: torch.Tensor) -> torch.Tensor:
    """Stored codes as float32 (fp8 through a 256-entry table: faster than the cast on CPU)."""
    if q.dtype == torch.int8:
        return q.to(torch.float32)
    key = (q.dtype, q.device)
    lut = _LUTS.get(key)
    if lut is None:
        lut = torch.arange(256, dtype=torch.uint8, device=q.device).view(q.dtype).to(torch.float32)
        _LUTS[key] = lut
    return torch.take(lut, q.view(torch.uint8).long())


@functools.lru_cache(maxsize=8)
def code_values(kv_dtype: torch.dtype) -> torch.Tensor:
    """The float32 values of the 256 codes of an 8-bit cache dtype, indexed by the code's byte (the native
    kernels' table; do not write to it)."""
    return codes_to_float(torch.arange(256, dtype=torch.int32).to(torch.uint8).view(kv_dtype)).contiguous()


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (codes_to_float(q) * scale).to(dtype)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A uint8 view (CPU index_copy/index_put are missing for float8)."""
    return t.view(torch.uint8) if t.dtype != torch.int8 else t


def write_quantized(
    kv_layer: torch.Tensor,
    scales_layer: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slots: torch.Tensor,
    block_size: int,
) -> None:
    """Write ``k``/``v`` (``[T, kv_heads, head_dim]``) at ``slots``: ``write_quantized_rows``, two parts."""
    write_quantized_rows(kv_layer, scales_layer, torch.stack((k, v), dim=1), slots, block_size)


def write_quantized_rows(
    kv_layer: torch.Tensor,
    scales_layer: torch.Tensor,
    rows: torch.Tensor,
    slots: torch.Tensor,
    block_size: int,
) -> None:
    """Write ``rows`` (``[T, parts, kv_heads, head_dim]``) at ``slots`` as the module docstring describes.

    ``kv_layer`` is ``[blocks, parts, block_size, kv_heads, head_dim]`` quantized, ``scales_layer``
    ``[blocks, parts, kv_heads]`` float32. Each block's new rows must be contiguous (they are: one
    sequence's consecutive positions).
    """
    if slots.numel() == 0:
        return
    dtype = kv_layer.dtype
    if kv_int4.is_int4(dtype):
        kv_int4.write_rows(kv_layer, scales_layer, rows, slots, block_size)
        return
    touched, inverse, offsets, start, _ = touched_blocks(slots, block_size)
    old_scales = scales_layer[touched]  # [u, parts, H]
    buf = dequantize(kv_layer[touched], old_scales[:, :, None, :, None])  # [u, parts, bs, H, D]
    positions = torch.arange(block_size, device=slots.device)
    keep = (positions[None, :] < start[:, None]).to(buf.dtype)  # earlier tokens of the same sequence
    buf.mul_(keep[:, None, :, None, None])
    buf[inverse, :, offsets] = rows.to(torch.float32)
    amax = buf.abs().amax(dim=(2, 4))  # [u, parts, H]
    scales = (amax / qmax(dtype)).clamp_(min=_MIN_SCALE)
    codes = quantize(buf, scales[:, :, None, :, None], dtype)
    _bytes(kv_layer)[touched] = _bytes(codes)
    scales_layer[touched] = scales

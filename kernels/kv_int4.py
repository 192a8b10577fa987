"""int4 KV cache: two 4-bit codes a byte, asymmetric, per block, part, KV head and group of channels.

Storage
-------
The codes tensor is ``uint8`` ``[layers, blocks, parts, block_size, kv_heads, head_dim // 2]``: byte
``j`` of a row holds channel ``2j`` in its low nibble and ``2j + 1`` in its high nibble. Beside it, the
parameters tensor is float32 ``[layers, blocks, parts, kv_heads, groups, 2]``: for each group of
``GROUP`` consecutive channels of a head (``groups = head_dim // GROUP``), its ``(low, step)`` over the
block's rows. A code ``c`` in ``0..15`` means ``low + c * step``. ``uint8`` is the storage dtype that
names this format everywhere (``--kv-cache-dtype int4``): no other KV format is stored as ``uint8``.

Why asymmetric, and why groups
------------------------------
Sixteen levels are few: a symmetric code spends one of them on the sign's mirror image of a range a
head's values rarely fill, and keys carry a few large channels (the rotary pairs of low frequency) that
set one shared range for every channel. A zero point (``low``) uses all 16 levels on the values'
actual range, and groups of channels along the head dimension keep a large channel's range from
swamping the rest. The measured trade (perplexity against bytes, ``bench.lab.kv_long_quality``) is in
docs/benchmarks.md: on the default model, groups of 64 (a whole head), 32, 16 and 8 channels raised
perplexity over float32 KV by 51%, 30%, 21% and 14% for 5,850, 5,940, 6,120 and 6,480 bytes a token.
16 channels a group costs 8 bytes of parameters per 16 x 16 codes (128 bytes) in a block of 16.

Write (requantize-on-write, as ``kernels/kv_quant.py``)
-------------------------------------------------------
A block's parameters must cover every token written to it, and decode appends one token at a time. On
every write the touched blocks are dequantized with their current parameters, rows after the block's
first written row are dropped, the new rows put in, and each group's ``low``/``step`` recomputed as
``min`` and ``(max - min) / 15`` over the block's *valid* rows (up to the last row written now; later
rows are stale and get code 0). The range only widens while a block fills, so an earlier token keeps
its code unless the range moved (then it is rounded once more). ``(x - low) / step`` is rounded to
nearest, ties to even, and clamped to ``0..15``. Every write is deterministic: the same writes give the
same bytes on any worker, so a disaggregated prefill and a colocated one agree.
"""

from __future__ import annotations

import torch

from kernels.block_writes import touched_blocks

STORAGE_DTYPE = torch.uint8
GROUP = 16  # channels of a head sharing one (low, step); the whole head when head_dim is smaller
LEVELS = 15
_MIN_STEP = 1e-12


def is_int4(dtype: torch.dtype) -> bool:
    return dtype == STORAGE_DTYPE


def group_size(head_dim: int) -> int:
    """Channels a group holds for ``head_dim`` (``GROUP``, or the whole head when it is smaller)."""
    return min(GROUP, head_dim)


def num_groups(head_dim: int) -> int:
    """Groups of a head; ValueError when ``head_dim`` is odd or not a multiple of the group."""
    size = group_size(head_dim)
    if head_dim % 2 or head_dim % size:
        raise ValueError(f"--kv-cache-dtype int4 needs a head dimension that is a multiple of {size} "
                         f"(two codes a byte, {size} channels a group), got {head_dim}")
    return head_dim // size


def pack(codes: torch.Tensor) -> torch.Tensor:
    """``uint8`` codes ``[..., D]`` (each < 16) -> bytes ``[..., D // 2]``, even channel in the low nibble."""
    pairs = codes.view(*codes.shape[:-1], -1, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """Bytes ``[..., D // 2]`` -> codes ``[..., D]`` (``uint8``)."""
    return torch.stack((packed & 15, packed >> 4), dim=-1).flatten(-2)


def dequantize(packed: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
    """Float32 values ``[..., D]`` of bytes ``[..., D // 2]`` with ``params`` ``[..., groups, 2]`` (broadcast
    against the rows' leading dimensions)."""
    codes = unpack(packed).to(torch.float32)
    groups = params.shape[-2]
    grouped = codes.view(*codes.shape[:-1], groups, -1)
    low, step = params[..., 0, None], params[..., 1, None]
    return (grouped * step + low).flatten(-2)


def write_rows(
    kv_layer: torch.Tensor,
    params_layer: torch.Tensor,
    rows: torch.Tensor,
    slots: torch.Tensor,
    block_size: int,
) -> None:
    """Write ``rows`` (``[T, parts, kv_heads, head_dim]``) at ``slots`` as the module docstring describes.

    ``kv_layer`` is ``uint8`` ``[blocks, parts, block_size, kv_heads, head_dim // 2]``, ``params_layer``
    float32 ``[blocks, parts, kv_heads, groups, 2]``. Each block's new rows must be contiguous (one
    sequence's consecutive positions).
    """
    if slots.numel() == 0:
        return
    touched, inverse, offsets, start, end = touched_blocks(slots, block_size)
    params = params_layer[touched]  # [u, parts, H, G, 2]
    buf = dequantize(kv_layer[touched], params[:, :, None])  # [u, parts, bs, H, D]
    positions = torch.arange(block_size, device=slots.device)
    buf.mul_((positions[None, :] < start[:, None]).to(buf.dtype)[:, None, :, None, None])
    buf[inverse, :, offsets] = rows.to(torch.float32)
    groups = params.shape[3]
    grouped = buf.view(*buf.shape[:-1], groups, -1)  # [u, parts, bs, H, G, size]
    valid = (positions[None, :] <= end[:, None])[:, None, :, None, None, None]
    low = grouped.masked_fill(~valid, float("inf")).amin(dim=(2, 5))  # [u, parts, H, G]
    high = grouped.masked_fill(~valid, float("-inf")).amax(dim=(2, 5))
    step = ((high - low) / LEVELS).clamp_(min=_MIN_STEP)
    lows, steps = low[:, :, None, :, :, None], step[:, :, None, :, :, None]
    codes = ((grouped - lows) / steps).round_().clamp_(0, LEVELS)
    codes.mul_(valid.to(codes.dtype))
    kv_layer[touched] = pack(codes.to(torch.uint8).flatten(-2))
    params_layer[touched] = torch.stack((low, step), dim=-1)

"""GGUF matrices as ``KMIX`` rows: the one record the native product reads for a fused matrix of mixed kinds.

``KMIX`` rows (``kernels/gguf_blocks.py``) hold, per row and 32 inputs, a float32 scale for each 16 inputs,
a float32 minimum and 32 byte codes ``c``; a weight is ``scale * (c - 32) + min``, which
``kernels/cpu_qpacked.c`` reads as Q6_K's records (11 bits a weight). Each type below converts into them
with its own values exactly: ``scale * (c - 32)`` is exact in float32 (a float16 scale, or one times a 6-bit
or int8 sub-block scale, times at most 8 bits), so the one rounding is the add of the minimum, where the
type's own dequantization (``gguf.quants``) rounds too, or none:

| type | c | scale | min |
|---|---|---|---|
| Q4_0 | q + 24 | d | 0 |
| Q4_1 | q + 32 | d | m |
| Q5_0 | q + 16 | d | 0 |
| Q5_1 | q + 32 | d | m |
| Q8_0 | q + 128 | d | -96 d (``d (q + 96) - 96 d`` is ``d q``, exactly) |
| Q4_K, Q5_K | q + 32 | d sc | -(dmin m) |
| Q6_K | q | d sc of each 16 inputs | 0 |

``cat_rows`` stacks a fused matrix's parts (QKV, gate/up) and converts them here when their kinds differ
(Q4_K_M's V in Q6_K beside Q4_K Q and K; a Q8_0 V beside Q5_0 Q and K).
"""

from __future__ import annotations

import torch

from kernels.gguf_blocks import BLOCK_BYTES, INT8_KINDS, QK, BlockKind, BlockMatrix, k_parts


def cat_rows(parts: list[BlockMatrix]) -> BlockMatrix | None:
    """The parts stacked by rows (as ``KMIX`` where their kinds differ), or None when their widths differ
    or a part is an fp8 checkpoint's (the caller dequantizes)."""
    first = parts[0]
    if any(p.in_features != first.in_features for p in parts):
        return None
    if any(p.kind != first.kind for p in parts):
        if not all(p.kind in INT8_KINDS for p in parts):
            return None
        parts = [mixed(p) for p in parts]
    return parts[0].with_rows(torch.cat([p.rows for p in parts]).contiguous())


def mixed(matrix: BlockMatrix) -> BlockMatrix:
    """A GGUF matrix as ``KMIX`` rows (the same values)."""
    if matrix.kind == BlockKind.KMIX:
        return matrix
    return _rows(*_parts(matrix.kind.name, matrix.rows, matrix.in_features), matrix.in_features)


def _rows(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, in_features: int) -> BlockMatrix:
    count, subs = codes.shape[:2]
    head = torch.cat([scales, mins[..., None]], dim=-1).contiguous().view(torch.uint8)  # [count, subs, 12]
    rows = torch.cat([head, codes.to(torch.uint8)], dim=-1).reshape(count, subs * BLOCK_BYTES[BlockKind.KMIX])
    return BlockMatrix(BlockKind.KMIX, rows.contiguous(), in_features)


def _half(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """The float16 at byte ``at`` of each block, as float32 ``[..., 1]``."""
    return blocks[..., at:at + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """A 32-input block's 16 bytes of codes -> its 32 nibbles (element e < 16 low, e >= 16 high)."""
    return torch.cat([qs & 15, qs >> 4], dim=-1)


def _parts(name: str, rows: torch.Tensor,
           in_features: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(codes, scales, mins)`` in KMIX's terms (the module docstring): int32 ``[rows, in / 32, 32]``,
    float32 ``[rows, in / 32, 2]`` and ``[rows, in / 32]``."""
    count = rows.shape[0]
    if name in ("Q4_K", "Q5_K", "Q6_K"):
        codes, scales, mins = k_parts(BlockKind[name], rows, in_features)
        return (codes if name == "Q6_K" else codes + 32), scales, mins
    size = BLOCK_BYTES[BlockKind[name]]
    blocks = rows.reshape(count, in_features // QK, size).to(torch.int32)
    raw = rows.reshape(count, in_features // QK, size)
    d = _half(raw, 0)
    zero = torch.zeros_like(d)
    if name == "Q8_0":
        q = raw[..., 2:].contiguous().view(torch.int8).to(torch.int32)
        codes, mins = q + 128, -96 * d
    elif name in ("Q4_0", "Q4_1"):
        q = _nibbles(blocks[..., size - 16:])
        codes, mins = (q + 24, zero) if name == "Q4_0" else (q + 32, _half(raw, 2))
    else:  # Q5_0, Q5_1: a 32-bit word of fifth bits, then the nibbles
        start = 2 if name == "Q5_0" else 4
        high = raw[..., start:start + 4].contiguous().view(torch.int32)  # little-endian, as gguf reads it
        fifth = (high >> torch.arange(QK, dtype=torch.int32)) & 1
        q = _nibbles(blocks[..., start + 4:]) | fifth << 4
        codes, mins = (q + 16, zero) if name == "Q5_0" else (q + 32, _half(raw, 2))
    return codes, d.expand(-1, -1, 2).contiguous(), mins[..., 0].contiguous()

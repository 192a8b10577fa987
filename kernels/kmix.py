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

from kernels.gguf_blocks import BLOCK_BYTES, INT8_KINDS, K_KINDS, BlockKind, BlockMatrix, block_parts, k_parts


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


def _parts(name: str, rows: torch.Tensor,
           in_features: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(codes, scales, mins)`` in KMIX's terms (the module docstring): int32 ``[rows, in / 32, 32]``,
    float32 ``[rows, in / 32, 2]`` and ``[rows, in / 32]``."""
    kind = BlockKind[name]
    if kind in K_KINDS:
        codes, scales, mins = k_parts(kind, rows, in_features)
        return (codes if kind == BlockKind.Q6_K else codes + 32), scales, mins
    q, d, m = block_parts(kind, rows, in_features)
    shift = {BlockKind.Q4_0: 24, BlockKind.Q5_0: 16, BlockKind.Q8_0: 128}.get(kind, 32)
    mins = -96 * d if kind == BlockKind.Q8_0 else (m if m is not None else torch.zeros_like(d))
    return q + shift, d.expand(-1, -1, 2).contiguous(), mins[..., 0].contiguous()

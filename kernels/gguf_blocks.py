"""A matrix kept in its GGUF blocks (Q4_0, Q4_1, Q8_0): what the loader hands the model instead of floats.

``BlockMatrix(kind, rows, in_features)`` is an ``[out, in]`` weight as llama.cpp stores it: ``rows`` a
``uint8`` tensor ``[out, in / 32 * block bytes]``, each row its 32-input blocks in order (Q4_0: a float16
``d`` and 16 bytes of codes, element ``e`` in the low nibble of byte ``e`` for ``e < 16``, the high nibble
of byte ``e - 16`` above; Q4_1: ``d``, a float16 ``m``, the same codes; Q8_0: ``d`` and 32 signed bytes).
Rows are whole blocks, so row slices, row concatenations (fused QKV and gate/up) and row permutations
(llama.cpp's Q/K order) work on ``rows`` directly.

``dequantize`` gives the float32 weight, bitwise ``gguf.quants.dequantize``'s (the same float32 products
and adds, in torch); ``lookup(ids)`` the rows of an embedding, the same values. The native product over
these blocks is ``kernels/cpu_qpacked.c`` (``NativeOps.qpack`` / ``qpacked_linear``), bitwise the float32
packed product of ``dequantize()``.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

import torch

QK = 32  # inputs per block


class BlockKind(IntEnum):
    """The formats kept in blocks; the values are the native library's format codes (``cpu_internal.h``)."""

    Q4_0 = 1
    Q4_1 = 2
    Q8_0 = 3


BLOCK_BYTES = {BlockKind.Q4_0: 18, BlockKind.Q4_1: 20, BlockKind.Q8_0: 34}


@dataclass(frozen=True)
class BlockMatrix:
    """An ``[out, in]`` weight in GGUF blocks; see the module docstring."""

    kind: BlockKind
    rows: torch.Tensor  # uint8 [out, in / QK * BLOCK_BYTES[kind]]
    in_features: int

    def __post_init__(self) -> None:
        if self.in_features % QK:
            raise ValueError(f"a {self.kind.name} matrix of {self.in_features} inputs: not whole blocks "
                             f"of {QK}")
        want = self.in_features // QK * BLOCK_BYTES[self.kind]
        if self.rows.dtype != torch.uint8 or self.rows.dim() != 2 or self.rows.shape[1] != want:
            raise ValueError(f"{self.kind.name} rows of shape {tuple(self.rows.shape)} {self.rows.dtype}; "
                             f"expected uint8 [out, {want}] for {self.in_features} inputs")

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows.shape[0], self.in_features)

    @property
    def nbytes(self) -> int:
        return self.rows.numel()

    def with_rows(self, rows: torch.Tensor) -> BlockMatrix:
        return BlockMatrix(self.kind, rows, self.in_features)

    def dequantize(self) -> torch.Tensor:
        """The float32 ``[out, in]`` weight (bitwise gguf's dequantization)."""
        return dequantize_rows(self.kind, self.rows, self.in_features)

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` (an embedding lookup), float32 ``[len(ids), in]``."""
        return dequantize_rows(self.kind, self.rows.index_select(0, ids.reshape(-1)), self.in_features)


def cat_rows(parts: list[BlockMatrix]) -> BlockMatrix | None:
    """The parts stacked by rows, or None when their kinds or widths differ (the caller dequantizes)."""
    first = parts[0]
    if any(p.kind != first.kind or p.in_features != first.in_features for p in parts):
        return None
    return first.with_rows(torch.cat([p.rows for p in parts]).contiguous())


def dequantize_rows(kind: BlockKind, rows: torch.Tensor, in_features: int) -> torch.Tensor:
    """Raw GGUF rows -> float32 ``[rows, in_features]`` (gguf.quants' arithmetic: float32 ``d * q``, plus
    ``m`` for Q4_1)."""
    count = rows.shape[0]
    blocks = rows.reshape(count, in_features // QK, BLOCK_BYTES[kind])
    d = blocks[..., 0:2].contiguous().view(torch.float16).float()
    if kind == BlockKind.Q8_0:
        q = blocks[..., 2:].contiguous().view(torch.int8).float()
        return (q * d).reshape(count, in_features)
    start = 4 if kind == BlockKind.Q4_1 else 2
    qs = blocks[..., start:]
    codes = torch.cat([qs & 15, qs >> 4], dim=-1)  # elements 0..15, then 16..31
    if kind == BlockKind.Q4_0:
        return (d * (codes.to(torch.int8) - 8).float()).reshape(count, in_features)
    m = blocks[..., 2:4].contiguous().view(torch.float16).float()
    return (d * codes.float() + m).reshape(count, in_features)

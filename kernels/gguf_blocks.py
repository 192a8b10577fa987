"""A matrix kept in its GGUF blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q6_K): what the loader hands the
model instead of floats.

``BlockMatrix(kind, rows, in_features)`` is an ``[out, in]`` weight as llama.cpp stores it: ``rows`` a
``uint8`` tensor ``[out, in / BLOCK_INPUTS * block bytes]``, each row its blocks in order (Q4_0: a float16
``d`` and 16 bytes of codes, element ``e`` in the low nibble of byte ``e`` for ``e < 16``, the high nibble
of byte ``e - 16`` above; Q4_1: ``d``, a float16 ``m``, the same codes; Q5_0 and Q5_1: Q4_0's and Q4_1's
with a little-endian 32-bit word of fifth bits before the codes, bit ``e`` for element ``e``; Q8_0: ``d``
and 32 signed bytes;
the K formats super-blocks of 256 inputs, ``k_parts`` says how they decode). Rows are whole blocks, so row
slices, row concatenations (fused QKV and gate/up) and row permutations (llama.cpp's Q/K order) work on
``rows`` directly.

``KMIX`` is no file's type: rows of 32-input sub-blocks of 44 bytes each, a float32 scale per 16 inputs,
a float32 minimum and 32 byte codes, the native Q6_K records' contents (``kernels/cpu_qrecords.c``),
into which ``kernels/kmix.py`` converts a fused matrix whose parts differ in kind (llama.cpp's Q4_K_M stores
some layers' V in Q6_K, their Q and K in Q4_K), each part with its own values exactly.

``FP8`` is no GGUF type either: an fp8 (e4m3) checkpoint's weight (``engine/checkpoint_quant.py``) as rows
of 32-input blocks of 36 bytes, the float32 scale that covers them (its block's, channel's or tensor's)
and 32 codes; a value is the code's times the scale, one float32 product, as the loader dequantizes it
(``fp8_matrix`` builds one).

``dequantize`` gives the float32 weight, bitwise ``gguf.quants.dequantize``'s (the same float32 products
and adds, in torch); ``lookup(ids)`` the rows of an embedding, the same values. The native product over
these blocks is ``kernels/cpu_qpacked.c`` (``NativeOps.qpack`` / ``qpacked_linear``), bitwise the float32
packed product of ``dequantize()``.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

import torch

QK = 32  # inputs per block (per sub-block of a K super-block): the native records' width
QK_K = 256  # inputs per K super-block


class BlockKind(IntEnum):
    """The formats kept in blocks; the values are the native library's format codes (``cpu_internal.h``;
    4 is its bfloat16 panels)."""

    Q4_0 = 1
    Q4_1 = 2
    Q8_0 = 3
    Q4_K = 5
    Q6_K = 6
    KMIX = 7  # Q4_K and Q6_K rows of one fused matrix (the module docstring)
    FP8 = 8  # an fp8 checkpoint's codes with a float32 scale per 32 inputs (the module docstring)
    Q5_0 = 9
    Q5_1 = 10
    Q5_K = 11


BLOCK_BYTES = {BlockKind.Q4_0: 18, BlockKind.Q4_1: 20, BlockKind.Q8_0: 34, BlockKind.Q4_K: 144,
               BlockKind.Q6_K: 210, BlockKind.KMIX: 12 + QK, BlockKind.FP8: 4 + QK, BlockKind.Q5_0: 22,
               BlockKind.Q5_1: 24, BlockKind.Q5_K: 176}
BLOCK_INPUTS = {**{kind: QK for kind in BlockKind}, BlockKind.Q4_K: QK_K, BlockKind.Q5_K: QK_K,
                BlockKind.Q6_K: QK_K}
GGUF_KINDS = (BlockKind.Q4_0, BlockKind.Q4_1, BlockKind.Q5_0, BlockKind.Q5_1, BlockKind.Q8_0, BlockKind.Q4_K,
              BlockKind.Q5_K, BlockKind.Q6_K)  # file types
INT8_KINDS = (*GGUF_KINDS, BlockKind.KMIX)  # the kinds with an int8-activation product (cpu_qint8.c)
K_KINDS = (BlockKind.Q4_K, BlockKind.Q5_K, BlockKind.Q6_K, BlockKind.KMIX)


@dataclass(frozen=True)
class BlockMatrix:
    """An ``[out, in]`` weight in GGUF blocks; see the module docstring."""

    kind: BlockKind
    rows: torch.Tensor  # uint8 [out, in / QK * BLOCK_BYTES[kind]]
    in_features: int

    def __post_init__(self) -> None:
        per = BLOCK_INPUTS[self.kind]
        if self.in_features % per:
            raise ValueError(f"a {self.kind.name} matrix of {self.in_features} inputs: not whole blocks "
                             f"of {per}")
        want = self.in_features // per * BLOCK_BYTES[self.kind]
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

    def narrow(self, dim: int, start: int, stop: int) -> BlockMatrix | None:
        """Rows ``start:stop`` (``dim`` 0) or inputs ``start:stop`` (``dim`` 1: whole blocks only, else
        None), as a tensor-parallel rank holds them."""
        if dim == 0:
            return self.with_rows(self.rows[start:stop].contiguous())
        per, size = BLOCK_INPUTS[self.kind], BLOCK_BYTES[self.kind]
        if start % per or stop % per:
            return None
        part = self.rows[:, start // per * size : stop // per * size].contiguous()
        return BlockMatrix(self.kind, part, stop - start)

    def dequantize(self) -> torch.Tensor:
        """The float32 ``[out, in]`` weight (bitwise gguf's dequantization)."""
        return dequantize_rows(self.kind, self.rows, self.in_features)

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` (an embedding lookup), float32 ``[len(ids), in]``."""
        return dequantize_rows(self.kind, self.rows.index_select(0, ids.reshape(-1)), self.in_features)


@dataclass(frozen=True)
class BlockStack:
    """An ``[E, out, in]`` stack of experts' weights, one ``BlockMatrix`` per expert: what a loader yields
    under a checkpoint's stacked tensor name (gpt-oss's MXFP4 experts) for the family's ``canonical`` to split
    into per-expert matrices."""

    experts: tuple[BlockMatrix, ...]


def dequantize_rows(kind: BlockKind, rows: torch.Tensor, in_features: int) -> torch.Tensor:
    """Raw GGUF rows -> float32 ``[rows, in_features]`` (gguf.quants' arithmetic: float32
    ``d * (q - offset)``, plus ``m`` for Q4_1 and Q5_1; the K formats as ``k_parts`` says; FP8 its code times
    its scale)."""
    count = rows.shape[0]
    if kind == BlockKind.FP8:
        blocks = rows.reshape(count, in_features // QK, BLOCK_BYTES[kind])
        scales = blocks[..., :4].contiguous().view(torch.float32)  # [count, blocks, 1]
        codes = blocks[..., 4:].contiguous().view(torch.float8_e4m3fn).to(torch.float32)
        return (codes * scales).reshape(count, in_features)
    if kind in K_KINDS:
        codes, scales, mins = k_parts(kind, rows, in_features)
        if kind in (BlockKind.Q4_K, BlockKind.Q5_K):  # gguf's d * q - dmin * min: + (-dmin * min)
            values = scales[..., :1] * codes.float() + mins[..., None]
        else:  # Q6_K's mins are 0: gguf's d * (q - 32)
            halves = codes.reshape(*codes.shape[:2], 2, QK // 2) - 32
            values = (scales[..., None] * halves.float()).flatten(-2) + mins[..., None]
        return values.reshape(count, in_features)
    q, d, m = block_parts(kind, rows, in_features)
    offset = {BlockKind.Q4_0: 8, BlockKind.Q5_0: 16}.get(kind, 0)
    values = d * (q - offset).float()
    return (values if m is None else values + m).reshape(count, in_features)


def block_parts(kind: BlockKind, rows: torch.Tensor,
                in_features: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A 32-input kind's rows (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) per block: ``(q, d, m)``, its codes as stored
    (int32 ``[rows, in / 32, 32]``: Q8_0's signed, Q5's with their fifth bits), ``d`` and ``m`` (Q4_1,
    Q5_1; else None) as float32 ``[rows, in / 32, 1]``."""
    blocks = rows.reshape(rows.shape[0], in_features // QK, BLOCK_BYTES[kind])
    d = blocks[..., 0:2].contiguous().view(torch.float16).float()
    if kind == BlockKind.Q8_0:
        return blocks[..., 2:].contiguous().view(torch.int8).to(torch.int32), d, None
    with_m = kind in (BlockKind.Q4_1, BlockKind.Q5_1)
    m = blocks[..., 2:4].contiguous().view(torch.float16).float() if with_m else None
    start = 4 if with_m else 2
    five = kind in (BlockKind.Q5_0, BlockKind.Q5_1)
    qs = blocks[..., start + (4 if five else 0):].to(torch.int32)
    q = torch.cat([qs & 15, qs >> 4], dim=-1)  # elements 0..15, then 16..31
    if five:  # gguf's (ql | qh << 4): bit e of the little-endian word is element e's fifth bit
        word = blocks[..., start:start + 4].contiguous().view(torch.int32)
        q = q | ((word >> torch.arange(QK, dtype=torch.int32)) & 1) << 4
    return q, d, m


def k_parts(kind: BlockKind, rows: torch.Tensor,
            in_features: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A K format's rows per 32-input sub-block: ``(codes, scales, mins)``, int32 ``[rows, in / 32, 32]``,
    float32 ``[rows, in / 32, 2]`` (the scale of each 16 inputs) and float32 ``[rows, in / 32]``.

    Q4_K (d, dmin float16; 12 bytes of 6-bit scales and mins, 8 sub-blocks; 128 bytes of 4-bit codes): a
    weight is ``scale * q + min`` with ``scale = d * sc`` (both halves) and ``min = -(dmin * m)``, the float32
    products gguf computes; Q5_K the same, with 32 bytes of fifth bits (bit j of byte l: sub-block j's
    input l) before the codes, q in 0..31. Q6_K (128 bytes of low nibbles, 64 of high bit pairs, 16 int8
    scales, d): a weight is ``scale * (q - 32)``, ``scale = d * sc`` of its 16 inputs, q in 0..63;
    ``mins`` are zero. KMIX: ``scale * (q - 32) + min``, as stored. These are the values
    ``kernels/cpu_qrecords.c``'s K records hold."""
    count = rows.shape[0]
    if kind == BlockKind.KMIX:
        subs = rows.reshape(count, in_features // QK, BLOCK_BYTES[kind])
        head = subs[..., :12].contiguous().view(torch.float32)  # [count, subs, 3]
        return subs[..., 12:].to(torch.int32), head[..., :2].contiguous(), head[..., 2].contiguous()
    supers = in_features // QK_K
    blocks = rows.reshape(count, supers, BLOCK_BYTES[kind])
    if kind in (BlockKind.Q4_K, BlockKind.Q5_K):
        d = blocks[..., 0:2].contiguous().view(torch.float16).float()  # [count, supers, 1]
        dmin = blocks[..., 2:4].contiguous().view(torch.float16).float()
        packed = blocks[..., 4:16].to(torch.int32)
        low, high, both = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
        sc = torch.cat([low & 63, (both & 15) | ((low >> 2) & 48)], dim=-1)  # [count, supers, 8]
        mn = torch.cat([high & 63, (both >> 4) | ((high >> 2) & 48)], dim=-1)
        five = kind == BlockKind.Q5_K
        qs = blocks[..., 48 if five else 16:].reshape(count, supers, 4, 1, QK).to(torch.int32)
        codes = torch.cat([qs & 15, qs >> 4], dim=-2).reshape(count, supers, 8, QK)
        if five:
            qh = blocks[..., 16:48].to(torch.int32)[..., None, :]  # [count, supers, 1, 32]
            codes = codes | ((qh >> torch.arange(8, dtype=torch.int32)[:, None]) & 1) << 4
        codes = codes.reshape(count, supers * 8, QK)
        scale = (d * sc.float()).reshape(count, supers * 8, 1).expand(-1, -1, 2).contiguous()
        return codes, scale, (-(dmin * mn.float())).reshape(count, supers * 8)
    ql = blocks[..., :128].reshape(count, supers, 2, 1, 64).to(torch.int32)
    ql = torch.cat([ql & 15, ql >> 4], dim=-2).reshape(count, supers, 2, 128)
    qh = blocks[..., 128:192].reshape(count, supers, 2, 1, 32).to(torch.int32)
    qh = torch.cat([(qh >> shift) & 3 for shift in (0, 2, 4, 6)], dim=-2).reshape(count, supers, 2, 128)
    codes = (ql | qh << 4).reshape(count, supers * 8, QK)
    sc = blocks[..., 192:208].contiguous().view(torch.int8).float()  # [count, supers, 16]
    d = blocks[..., 208:210].contiguous().view(torch.float16).float()
    scale = (d * sc).reshape(count, supers * 8, 2)
    return codes, scale, torch.zeros(count, supers * 8)


def fp8_matrix(codes: torch.Tensor, scales: torch.Tensor) -> BlockMatrix:
    """An ``FP8`` matrix of ``codes`` (float8_e4m3fn ``[out, in]``) and ``scales`` (float32 ``[out, in /
    32]``, the scale of each row's 32 inputs)."""
    out_features, in_features = codes.shape
    blocks = in_features // QK
    shape_ok = not in_features % QK and tuple(scales.shape) == (out_features, blocks)
    if codes.dtype != torch.float8_e4m3fn or not shape_ok:
        raise ValueError(f"fp8 codes {tuple(codes.shape)} {codes.dtype} with scales {tuple(scales.shape)}: "
                         f"expected float8_e4m3fn [out, in] (in a multiple of {QK}) and [out, in / {QK}]")
    head = scales.to(torch.float32).contiguous().view(torch.uint8).reshape(out_features, blocks, 4)
    body = codes.contiguous().view(torch.uint8).reshape(out_features, blocks, QK)
    rows = torch.cat([head, body], dim=-1).reshape(out_features, blocks * BLOCK_BYTES[BlockKind.FP8])
    return BlockMatrix(BlockKind.FP8, rows.contiguous(), in_features)

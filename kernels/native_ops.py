"""The decoder's per-layer small ops and the product as native calls (``cpu_ops.c``, ``cpu_packed.c``).

At decode sizes each torch op costs more in dispatch and allocation than in
arithmetic (a norm of one 576-float row, a rope over 15 heads), so a decode layer
spends as much time in its dozen small ops as in reading its weights. ``NativeOps``
does each group in one call through ctypes, on float32 CPU tensors only:

- ``add_rms_norm(hidden, delta, weight, eps)``: ``hidden += delta`` in place (when
  ``delta`` is given), returns ``rms_norm(hidden, weight, eps)`` (``kernels.norm``);
  the residual add is bitwise torch's, the norm equal to rounding (the sum of
  squares is taken in another order);
- ``rope_(x, cos, sin, heads)``: rotates the first ``heads`` heads of ``x``
  (``[T, >= heads, head_dim]``, contiguous heads) in place, bitwise
  ``kernels.rope.apply_rotary``;
- ``silu_mul(gate_up)``: ``kernels.activation.silu_mul``, equal to rounding (a
  polynomial ``exp``, about 1 ulp);
- ``pack(weight)``: the ``[out, in]`` weight in ``cpu_packed.c``'s panels
  (``[ceil(out / PANEL), in, PANEL]``, zero-padded), made once at load;
- ``packed_linear(x, packed, out_features, bias)``: ``F.linear`` for ``x`` of
  ``[rows, in]`` (any ``rows`` >= 1: decode steps and prompt chunks) against the
  packed weight, output panels split over the threads. Each output is one FMA
  chain over ``in`` in order, so its value depends on its row of ``x`` and its
  weight row only: bitwise the same whatever the row count, the thread count
  and the other rows (a token rounds alike in a prompt chunk and a decode step);
  equal to ``F.linear`` to rounding;
- ``unpack(packed, out_features)``: the weight back, bitwise;
- ``linear(x, weight, bias)``: ``pack`` then ``packed_linear``, for one-off
  products (bitwise the products of a packed layer with the same weight rows);
- ``qpack(matrix)``, ``qpacked_linear(x, packed, kind, out_features, bias)``,
  ``qunpack(packed, kind, out_features)``: the same three for a weight kept in
  its GGUF blocks (``kernels.gguf_blocks.BlockMatrix``, ``cpu_qpacked.c``):
  the product is bitwise ``packed_linear`` over ``matrix.dequantize()``, and
  ``qunpack`` gives that float32 weight;
- ``qpacked_linear(..., int8=True)``: the same product with its activations quantized to int8 per block
  of 32 inputs and integer dot products (``cpu_qint8.c``, llama.cpp's arithmetic, AVX512-VNNI): not the
  float32 values, but bitwise the same whatever the row count, the thread count and the other rows;
  ``int8_available`` says whether this build has it (``require_int8`` raises, naming the CPU flag, where
  it has not).
- ``pack_bf16(weight)``, ``bf16_linear(x, packed, out_features, bias)``, ``unpack_bf16(packed,
  out_features)``: the same three for a weight stored in bfloat16 (``cpu_bf16.c``, ``--dtype bfloat16``
  on CPU): the activations rounded to bfloat16 at the input, the products summed in float32 in one
  chain per output (AVX512-BF16's ``vdpbf16ps`` where the CPU has it, ``bf16_native``), bitwise the same
  whatever the row count, the thread count and the other rows; ``unpack_bf16`` gives the bfloat16
  weight's float32 values.

Callers check ``usable`` for their tensors (float32, CPU, contiguous where
stated) and take the torch path otherwise. Threads: ``torch.get_num_threads()``
at each call, on torch's OpenMP team (see ``kernels/cpu_native.py``).
``native_ops()`` is ``None`` when the library cannot be built (an engine with
``--no-native-kernels`` does not call it).
"""

from __future__ import annotations

import functools

import torch

from kernels.cpu_native import load_library, native_available
from kernels.gguf_blocks import INT8_KINDS, QK, BlockKind, BlockMatrix

PANEL = 16  # output features per packed panel (cpu_internal.h)
INT8_FLAG = 0x80  # a format's int8-activation flag (cpu_internal.h's WF_I8)
BF16_FORMAT = 4  # the bfloat16 panels' format (cpu_internal.h's WF_BF16)


class NativeOps:
    """ctypes calls into ``cpu_ops.c``; see the module docstring for each op's contract."""

    def __init__(self) -> None:
        lib = load_library()
        if lib is None:
            raise RuntimeError("native CPU kernel library is unavailable")
        self._pack = lib.pdserve_pack_f32
        self._packed = lib.pdserve_packed_f32
        self._norm = lib.pdserve_add_rms_norm_f32
        self._rope = lib.pdserve_rope_f32
        self._silu_mul = lib.pdserve_silu_mul_f32
        self._qpack = lib.pdserve_qpack
        self._qdequantize = lib.pdserve_qdequantize
        self._qpacked = lib.pdserve_qpacked_f32
        self._record_bytes = {kind: int(lib.pdserve_qrecord_bytes(kind)) for kind in BlockKind}
        self.int8_available = bool(lib.pdserve_i8_available())
        self._pack_bf16 = lib.pdserve_pack_bf16
        self._unpack_bf16 = lib.pdserve_unpack_bf16
        self._packed_bf16 = lib.pdserve_packed_bf16
        self.bf16_native = bool(lib.pdserve_bf16_native())  # vdpbf16ps (AVX512-BF16), else plain FMAs

    def require_int8(self, flag: str = "--gguf-activations int8") -> None:
        """Raise ``ValueError`` where this build has no int8 product (a CPU without AVX512-VNNI)."""
        if not self.int8_available:
            raise ValueError(f"{flag} needs a CPU with AVX512-VNNI (the avx512_vnni flag in /proc/cpuinfo) "
                             f"and AVX512-BW; this one has not: use --gguf-activations float32")

    @staticmethod
    def usable(*tensors: torch.Tensor) -> bool:
        """Whether every tensor is a float32 CPU tensor (the only kind these kernels take)."""
        return all(t.dtype == torch.float32 and t.device.type == "cpu" for t in tensors)

    def add_rms_norm(self, hidden: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> torch.Tensor:
        """``hidden += delta`` (in place), then ``rms_norm(hidden, weight, eps)`` as a new tensor."""
        rows, dim = hidden.shape
        if not hidden.is_contiguous() or (delta is not None and not delta.is_contiguous()):
            raise ValueError("add_rms_norm needs contiguous hidden and delta")
        out = torch.empty_like(hidden)
        self._norm(hidden.data_ptr(), None if delta is None else delta.data_ptr(), weight.data_ptr(),
                   out.data_ptr(), rows, dim, eps, torch.get_num_threads())
        return out

    def rope_(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int) -> None:
        """Rotate heads ``0..heads-1`` of ``x`` (``[T, H, head_dim]``) in place by ``cos``/``sin``
        (``[T, 1, head_dim]``)."""
        tokens, _, head_dim = x.shape
        if x.stride(2) != 1 or x.stride(1) != head_dim or not (cos.is_contiguous() and sin.is_contiguous()):
            raise ValueError("rope_ needs contiguous heads and contiguous cos/sin")
        self._rope(x.data_ptr(), x.stride(0), cos.data_ptr(), sin.data_ptr(), tokens, heads, head_dim,
                   torch.get_num_threads())

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` for contiguous ``gate_up = [gate | up]``."""
        rows, width = gate_up.shape
        if not gate_up.is_contiguous():
            gate_up = gate_up.contiguous()
        out = gate_up.new_empty(rows, width // 2)
        self._silu_mul(gate_up.data_ptr(), out.data_ptr(), rows, width // 2, torch.get_num_threads())
        return out

    @staticmethod
    def packed_shape(out_features: int, in_features: int) -> tuple[int, int, int]:
        """The packed tensor's shape for an ``[out_features, in_features]`` weight."""
        return (-(-out_features // PANEL), in_features, PANEL)

    @staticmethod
    def unpack(packed: torch.Tensor, out_features: int) -> torch.Tensor:
        """The ``[out_features, in]`` weight ``pack`` was given, bitwise (a new tensor)."""
        return packed.permute(0, 2, 1).reshape(-1, packed.shape[1])[:out_features].contiguous()

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        """``weight`` (float32 ``[out, in]``) in the packed layout (a new tensor)."""
        out_features, in_features = weight.shape
        weight = weight.contiguous()
        packed = weight.new_empty(self.packed_shape(out_features, in_features))
        self._pack(weight.data_ptr(), packed.data_ptr(), out_features, in_features)
        return packed

    def packed_linear(self, x: torch.Tensor, packed: torch.Tensor, out_features: int,
                      bias: torch.Tensor | None) -> torch.Tensor:
        """``F.linear(x, weight, bias)`` for ``x`` of ``[rows, in]``, ``packed = pack(weight)``."""
        in_features = packed.shape[1]
        if tuple(packed.shape) != self.packed_shape(out_features, in_features) or not packed.is_contiguous():
            raise ValueError(f"a packed weight of shape {tuple(packed.shape)} for {out_features} outputs")
        x, bias, y = _operands(x, bias, in_features, out_features)
        self._packed(packed.data_ptr(), x.data_ptr(), _address(bias), y.data_ptr(), x.shape[0], out_features,
                     in_features, torch.get_num_threads())
        return y

    def qpacked_shape(self, kind: BlockKind, out_features: int, in_features: int) -> tuple[int, int, int]:
        """The packed blocks' shape (``uint8``): ``[panels, in / 32, record bytes]``."""
        return (-(-out_features // PANEL), in_features // QK, self._record_bytes[kind])

    def qpack(self, matrix: BlockMatrix) -> torch.Tensor:
        """``matrix`` in ``cpu_qrecords.c``'s panels of records (a new ``uint8`` tensor)."""
        out_features, in_features = matrix.shape
        raw = matrix.rows.contiguous()
        packed = torch.empty(self.qpacked_shape(matrix.kind, out_features, in_features), dtype=torch.uint8)
        if self._qpack(matrix.kind, raw.data_ptr(), packed.data_ptr(), out_features, in_features):
            raise ValueError(f"cannot pack a {matrix.kind.name} matrix of shape {matrix.shape}")
        return packed

    def qunpack(self, packed: torch.Tensor, kind: BlockKind, out_features: int) -> torch.Tensor:
        """The float32 ``[out, in]`` weight of ``qpack``'s blocks (bitwise ``BlockMatrix.dequantize``)."""
        panels, blocks, _ = packed.shape
        floats = torch.empty((panels, blocks * QK, PANEL), dtype=torch.float32)
        self._qdequantize(kind, packed.data_ptr(), floats.data_ptr(), panels * PANEL, blocks * QK)
        return self.unpack(floats, out_features)

    def qpacked_linear(self, x: torch.Tensor, packed: torch.Tensor, kind: BlockKind, out_features: int,
                       bias: torch.Tensor | None, int8: bool = False) -> torch.Tensor:
        """``packed_linear`` over the dequantized weight, for ``x`` of ``[rows, in]`` (bitwise); ``int8``:
        the int8-activation product instead (``cpu_qint8.c``)."""
        in_features = packed.shape[1] * QK
        want = self.qpacked_shape(kind, out_features, in_features)
        if tuple(packed.shape) != want or not packed.is_contiguous():
            raise ValueError(f"packed {kind.name} blocks of shape {tuple(packed.shape)} for {out_features} "
                             f"outputs")
        x, bias, y = _operands(x, bias, in_features, out_features)
        if int8:
            if kind not in INT8_KINDS:
                raise ValueError(f"the int8-activation product takes GGUF blocks, not {kind.name}")
            self.require_int8()
        fmt = kind | (INT8_FLAG if int8 else 0)
        self._qpacked(fmt, packed.data_ptr(), x.data_ptr(), _address(bias), y.data_ptr(), x.shape[0],
                      out_features, in_features, torch.get_num_threads())
        return y

    @staticmethod
    def bf16_shape(out_features: int, in_features: int) -> tuple[int, int, int]:
        """The bfloat16 panels' shape (``int16`` storage): ``[panels, in / 2, PANEL * 2]``."""
        return (-(-out_features // PANEL), in_features // 2, PANEL * 2)

    def pack_bf16(self, weight: torch.Tensor) -> torch.Tensor:
        """``weight`` (float32 ``[out, in]``, ``in`` even) rounded to bfloat16 in ``cpu_bf16.c``'s panels."""
        out_features, in_features = weight.shape
        if in_features % 2:
            raise ValueError(f"a bfloat16 product needs an even input width, not {in_features}")
        weight = weight.contiguous()
        packed = torch.empty(self.bf16_shape(out_features, in_features), dtype=torch.int16)
        self._pack_bf16(weight.data_ptr(), packed.data_ptr(), out_features, in_features)
        return packed

    def unpack_bf16(self, packed: torch.Tensor, out_features: int) -> torch.Tensor:
        """The float32 ``[out, in]`` values of ``pack_bf16``'s weight (its bfloat16 values, exactly)."""
        weight = torch.empty(out_features, packed.shape[1] * 2, dtype=torch.float32)
        self._unpack_bf16(packed.data_ptr(), weight.data_ptr(), out_features, weight.shape[1])
        return weight

    def bf16_linear(self, x: torch.Tensor, packed: torch.Tensor, out_features: int,
                    bias: torch.Tensor | None) -> torch.Tensor:
        """``x @ W.T + bias`` for float32 ``x`` of ``[rows, in]`` and ``packed = pack_bf16(W)`` (the
        arithmetic in ``cpu_bf16.c``'s header)."""
        in_features = packed.shape[1] * 2
        if tuple(packed.shape) != self.bf16_shape(out_features, in_features) or not packed.is_contiguous():
            raise ValueError(f"bfloat16 panels of shape {tuple(packed.shape)} for {out_features} outputs")
        x, bias, y = _operands(x, bias, in_features, out_features)
        self._packed_bf16(packed.data_ptr(), x.data_ptr(), _address(bias), y.data_ptr(), x.shape[0],
                          out_features, in_features, torch.get_num_threads())
        return y

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``F.linear(x, weight, bias)``: ``pack(weight)``, then ``packed_linear``."""
        return self.packed_linear(x, self.pack(weight), weight.shape[0], bias)


def _operands(x: torch.Tensor, bias: torch.Tensor | None, in_features: int,
              out_features: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """A product's ``x`` (``[rows, in_features]``) and bias, contiguous, and its new output; ValueError on
    a width that does not fit."""
    if x.shape[-1] != in_features:
        raise ValueError(f"input of width {x.shape[-1]} for a product of {in_features} inputs")
    x = x.contiguous()
    return x, None if bias is None else bias.contiguous(), x.new_empty(x.shape[0], out_features)


def _address(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


@functools.lru_cache(maxsize=1)
def _ops() -> NativeOps | None:
    return NativeOps() if native_available() else None


def native_ops() -> NativeOps | None:
    """The shared ``NativeOps``, or ``None`` when native kernels are off or cannot be built here."""
    return _ops() if native_available() else None

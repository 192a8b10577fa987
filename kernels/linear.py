"""Linear layers with weights prepared once at load for the fastest CPU product.

``PreparedLinear(weight, bias, kernel)`` computes ``x @ weight.T + bias`` for
``x`` of shape ``[rows, in]``. Contract:

- the weight is read when the object is built (and packed then); changing the
  weight afterwards is not seen: whoever reloads weights builds a new one
  (``CausalLM.load_weights`` does);
- the result has ``x``'s dtype and shape ``[rows, out]`` and equals
  ``F.linear(x, weight, bias)`` up to float rounding (the kernels sum in a
  different order; they are not bitwise equal to each other);
- the kernel used depends only on ``rows``, never on timing, so a run is
  deterministic for a given batch shape.

Kernels (``kernel=``):

- ``"native"`` (the engine's default) packs the weight once into the native library's panels
  (``kernels.native_ops.NativeOps.pack``: ``[ceil(out / 16), in, 16]``, a copy of the weight's size)
  and takes every row count with ``NativeOps.packed_linear``: a register tile of 8 rows x 48 features
  (AVX-512; 6 x 16 otherwise) with no horizontal sums. Each output is one FMA chain over ``in``, so a
  row's result does not depend on the other rows or the row count: a token rounds alike in a prompt
  chunk, a decode step, and on either side of a disaggregated handoff. Where the native library cannot
  be built it is ``"prepacked"``.
- ``"prepacked"``: at one row MKL's packed SGEMM (``torch.ops.mkl._mkl_linear`` on a weight packed by
  ``_mkl_reorder_linear_weight`` for one row: one more copy of each weight, and MKL's packed product
  serves only the row count it was packed for); up to ``LARGE_ROWS`` rows oneDNN's inner product
  (``torch.ops.mkldnn._linear_pointwise``); above (prompt chunks) the product ``LARGE_PRODUCT`` names,
  fixed per machine by ``large_product``: torch's default (MKL's SGEMM) on Intel CPUs, where MKL takes
  its AVX-512 path, and oneDNN's inner product on other x86 CPUs, where MKL runs at the AVX2 rate.
  ``--large-product mkl|onednn`` (``EngineConfig.large_product``, set for the process by
  ``set_large_product``) picks one by hand; every worker of a deployment gets the same config, so its
  prompts round alike (or disaggregated and colocated outputs could differ).
- ``"plain"``: ``F.linear`` (torch's default). Other dtypes and devices always use it.

A weight kept in its GGUF blocks (``blocks=``, a ``kernels.gguf_blocks.BlockMatrix``; the
``weight`` given beside it is the model's zero-stride stand-in of its shape) takes the native
library's product over the blocks (``NativeOps.qpacked_linear``): bitwise the ``"native"`` product of
the dequantized weight, reading the blocks' bytes. Where the native kernel is not in use the blocks
are dequantized and the weight takes the kernel asked for, as a float weight would. ``set_int8_activations``
turns such a product to the int8-activation one (``NativeOps.qpacked_linear(..., int8=True)``,
``kernels/cpu_qint8.c``: llama.cpp's arithmetic, not the float32 values); products without GGUF blocks (an
fp8 checkpoint's codes, ``BlockKind.FP8``, included) ignore it.
``to_bf16`` turns a native float product into the bfloat16 one (``NativeOps.bf16_linear``,
``kernels/cpu_bf16.c``: the weight stored in bfloat16, the activations rounded to bfloat16 at the input,
float32 sums; ``--dtype bfloat16`` on CPU), which then holds only the bfloat16 panels.

Blocks on a CUDA device, or with ``kernel="triton"`` under ``TRITON_INTERPRET=1`` (how CPU tests run
it), stay as the blocks' rows on the weight's device when their kind is one of ``TRITON_KINDS`` (an fp8
checkpoint's ``FP8``, MXFP4 experts' ``Q5_0``, every GGUF kind kept, ``KMIX``) and take the Triton
product over them (``kernels/triton_blocks.py``); ``packed`` is those rows. Other kinds are dequantized
there. ``"triton"`` multiplies float weights with ``F.linear``.

Figures for each kernel, per row count: docs/benchmarks.md ("One packed product for every row count",
"Prompt chunks on oneDNN's product off Intel CPUs"), measured with ``python -m bench.lab.linear_kernels``.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F

from kernels.gguf_blocks import INT8_KINDS, BlockKind, BlockMatrix, dequantize_rows
from kernels.native_ops import BF16_FORMAT, INT8_FLAG, native_ops
from kernels.triton_configs import TRITON_KINDS, interpreting

LinearKernel = Literal["plain", "prepacked", "native", "triton"]
LINEAR_KERNELS: tuple[LinearKernel, ...] = ("plain", "prepacked", "native", "triton")
LARGE_ROWS = 64  # "prepacked": above this many rows, LARGE_PRODUCT (see the docstring)
LargeProduct = Literal["mkl", "onednn"]


def cpu_vendor(cpuinfo: str = "/proc/cpuinfo") -> str:
    """The CPU's ``vendor_id`` (``GenuineIntel``, ``AuthenticAMD``, ...), or "" where none is listed."""
    try:
        for line in Path(cpuinfo).read_text().splitlines():
            if line.startswith("vendor_id"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def large_product(vendor: str, override: str | None = None) -> LargeProduct:
    """The product of more than ``LARGE_ROWS`` rows: ``override`` (``EngineConfig.large_product``) when
    set and not ``auto``, else MKL's on Intel CPUs and on CPUs that list no vendor, oneDNN's on the
    others."""
    if override and override != "auto":
        if override not in ("mkl", "onednn"):
            raise ValueError(f"large_product must be mkl or onednn, not {override!r}")
        return "mkl" if override == "mkl" else "onednn"
    return "mkl" if vendor in ("GenuineIntel", "") else "onednn"


LARGE_PRODUCT: LargeProduct = large_product(cpu_vendor())


def set_large_product(override: str) -> None:
    """The process's product of prompt chunks (the engine sets it from its config when it starts: one
    deployment's workers compute prompts alike)."""
    global LARGE_PRODUCT
    LARGE_PRODUCT = large_product(cpu_vendor(), override)


def triton_blocks_usable(device: torch.device, kernel: str) -> bool:
    """Whether kept blocks on ``device`` take the Triton product (``kernels/triton_blocks.py``): on a CUDA
    device with Triton installed whatever ``kernel`` says, and on CPU for ``kernel="triton"`` under
    ``TRITON_INTERPRET=1``."""
    if device.type == "cuda":
        return importlib.util.find_spec("triton") is not None
    return kernel == "triton" and interpreting()


def prepacked_available(weight: torch.Tensor) -> bool:
    """Whether this build and ``weight`` (fp32, CPU) can use the prepacked kernels."""
    return (weight.device.type == "cpu" and weight.dtype == torch.float32
            and torch.backends.mkl.is_available() and torch.backends.mkldnn.is_available())


def mkl_pack(weight: torch.Tensor, rows: int = 1) -> torch.Tensor:
    """MKL's packed form of ``weight`` for products of exactly ``rows`` rows."""
    return torch.ops.mkl._mkl_reorder_linear_weight(weight.contiguous(), rows)


def mkl_linear(x: torch.Tensor, packed: torch.Tensor, weight: torch.Tensor,
               bias: torch.Tensor | None, rows: int) -> torch.Tensor:
    """Packed SGEMM; ``x`` must have ``rows`` rows or torch falls back to ``F.linear``."""
    return torch.ops.mkl._mkl_linear(x, packed, weight, bias, rows)


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """oneDNN inner product on a dense ``[out, in]`` weight (primitives cached by oneDNN)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def prepared_linear(x: torch.Tensor, weight: torch.Tensor, packed_row: torch.Tensor | None,
                    bias: torch.Tensor | None) -> torch.Tensor:
    """The prepacked product as a plain function of tensors (``packed_row`` None: ``F.linear``).

    Traceable by torch.compile: the kernel depends on ``x``'s static row count only.
    """
    if packed_row is None or x.dim() != 2 or x.dtype != torch.float32 or not x.shape[0]:
        return F.linear(x, weight, bias)
    if x.shape[0] == 1:
        return mkl_linear(x, packed_row, weight, bias, 1)
    return _many_rows(x, weight, bias)


def _many_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """More than one row: oneDNN's product up to ``LARGE_ROWS`` rows, ``LARGE_PRODUCT`` above."""
    if x.shape[0] > LARGE_ROWS and LARGE_PRODUCT == "mkl":
        return F.linear(x, weight, bias)
    return onednn_linear(x, weight, bias)


class PreparedLinear:
    """``x @ weight.T + bias`` with the weight prepared for ``kernel``; see the module docstring."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 kernel: LinearKernel = "prepacked", blocks: BlockMatrix | None = None) -> None:
        if kernel not in LINEAR_KERNELS:
            raise ValueError(f"unknown linear kernel {kernel!r}; choose one of {LINEAR_KERNELS}")
        self.kind: BlockKind | None = None  # set: ``packed`` holds GGUF blocks of this kind
        self.int8_activations = False  # the blocks' product quantizes its activations (set_int8_activations)
        self.bf16 = False  # ``packed`` holds bfloat16 panels (to_bf16)
        self.triton = False  # ``packed`` holds block rows the Triton product reads (module docstring)
        if blocks is not None:
            if tuple(blocks.shape) != tuple(weight.shape):
                raise ValueError(f"blocks of shape {blocks.shape} for a weight of shape "
                                 f"{tuple(weight.shape)}")
            on_triton = triton_blocks_usable(weight.device, kernel)
            self.triton = on_triton and blocks.kind in TRITON_KINDS
            if not self.triton and (on_triton or kernel != "native" or native_ops() is None
                                    or not prepacked_available(weight)):
                weight, blocks = blocks.dequantize().to(device=weight.device, dtype=weight.dtype), None
        self.weight = weight.detach()
        self.bias = bias.detach() if bias is not None else None
        self.out_features, self.in_features = weight.shape
        packs = prepacked_available(weight) and kernel != "triton"
        self.kernel: LinearKernel = "triton" if self.triton else kernel if packs else "plain"
        self._native = native_ops() if self.kernel == "native" else None
        if self.kernel == "native" and self._native is None:
            self.kernel = "prepacked"
        self.packed_row = mkl_pack(self.weight, 1) if self.kernel == "prepacked" else None
        # "native": the weight in the native library's panels (cpu_packed.c), or its blocks (cpu_qpacked.c)
        self.packed: torch.Tensor | None = None
        if self.triton and blocks is not None:
            self.kind, self.packed = blocks.kind, blocks.rows.to(weight.device)
        elif self._native is not None and blocks is not None:
            self.kind, self.packed = blocks.kind, self._native.qpack(blocks)
        elif self._native is not None:
            self.packed = self._native.pack(self.weight)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.triton and self.packed is not None and self.kind is not None:
            from kernels.triton_blocks import triton_block_linear

            return triton_block_linear(x, self.packed, self.kind, self.out_features, self.bias)
        if self._native is not None and self.packed is not None:
            if x.dtype != torch.float32 or x.device.type != "cpu":
                raise TypeError(f"the native product takes float32 CPU inputs, not {x.dtype} on {x.device}")
            rows = x if x.dim() == 2 else x.reshape(-1, self.in_features)
            if self.bf16:
                y = self._native.bf16_linear(rows, self.packed, self.out_features, self.bias)
            elif self.kind is not None:
                y = self._native.qpacked_linear(rows, self.packed, self.kind, self.out_features, self.bias,
                                                self.int8_activations)
            else:
                y = self._native.packed_linear(rows, self.packed, self.out_features, self.bias)
            return y if x.dim() == 2 else y.view(*x.shape[:-1], self.out_features)
        return prepared_linear(x, self.weight, self.packed_row, self.bias)

    def set_int8_activations(self, on: bool) -> None:
        """Quantize the activations to int8 in the product over the blocks (``on``), or not; a product without
        GGUF blocks (floats, an fp8 checkpoint's codes) stays as it is. Raises ``ValueError`` where this build
        has no int8 product (no AVX512-VNNI)."""
        if self.kind is None or self.kind not in INT8_KINDS or self._native is None:
            return
        if on:
            self._native.require_int8()
        self.int8_activations = on

    def to_bf16(self) -> bool:
        """Store the weight in bfloat16 and multiply in bfloat16 from now on (the native float product only,
        with an even input width; the float32 panels are dropped). Returns whether it did."""
        if (self._native is None or self.packed is None or self.kind is not None or self.in_features % 2
                or self.bf16):
            return self.bf16
        self.packed = self._native.pack_bf16(self.unpacked())
        self.bf16 = True
        return True

    @property
    def native_format(self) -> int:
        """The native library's format of ``packed`` (``cpu_internal.h``'s ``WF_*``: 0 float32 panels, a
        ``BlockKind``, ``BF16_FORMAT``), with ``INT8_FLAG`` where the product takes int8 activations."""
        base = BF16_FORMAT if self.bf16 else int(self.kind or 0)
        return base | (INT8_FLAG if self.int8_activations else 0)

    def unpacked(self) -> torch.Tensor:
        """The ``[out, in]`` float weight from the packed copy (bitwise the weight packed, the blocks'
        dequantized values, or the bfloat16 weight's values)."""
        if self.triton and self.packed is not None and self.kind is not None:
            return dequantize_rows(self.kind, self.packed, self.in_features).to(self.weight.dtype)
        if self.packed is None or self._native is None:
            raise ValueError(f"only the native kernel holds a packed copy, not {self.kernel!r}")
        if self.bf16:
            return self._native.unpack_bf16(self.packed, self.out_features)
        if self.kind is not None:
            return self._native.qunpack(self.packed, self.kind, self.out_features)
        return self._native.unpack(self.packed, self.out_features)

    def release_weight(self, placeholder: torch.Tensor) -> None:
        """Drop the reference to the ``[out, in]`` weight (the native kernel reads the packed copy only),
        keeping ``placeholder`` (the model's zero-stride stand-in) as ``weight``."""
        if self.packed is None:
            raise ValueError(f"only the native kernel's packed copy stands alone, not {self.kernel!r}'s")
        self.weight = placeholder

    @property
    def extra_bytes(self) -> int:
        """Bytes held beyond the weight itself (the packed copy)."""
        p = self.packed_row if self.packed is None else self.packed
        return 0 if p is None else p.numel() * p.element_size()


@torch.library.custom_op("pdserve::prepared_linear", mutates_args=())
def prepared_linear_op(x: torch.Tensor, weight: torch.Tensor, packed_row: torch.Tensor | None,
                       bias: torch.Tensor | None) -> torch.Tensor:
    """``prepared_linear`` as one opaque op for torch.compile.

    Inductor lowers MKL's and oneDNN's linear ops only for weights frozen into the
    graph as constants; compiled code that takes the weights as arguments calls
    this op instead and runs the same kernels as eager.
    """
    return prepared_linear(x, weight, packed_row, bias)


@prepared_linear_op.register_fake
def _prepared_linear_fake(x: torch.Tensor, weight: torch.Tensor, packed_row: torch.Tensor | None,
                          bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])

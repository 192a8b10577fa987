"""Every decoder layer of a few-row float32 step, and the final norm, in one native call (``cpu_decoder.c``).

A batch-1 decode step of a small model reads its weights in about as long as its ~10 per-layer calls
(norms, products, rope, the KV write, attention) cost in ctypes, torch allocations and fork/joins of the
thread team. ``NativeDecoder.run`` does the whole stack in one call on one OpenMP team, with barriers
between the phases (the C file lists them), and returns what ``CausalLM.forward`` returns: the
final-normed hidden states ``[T, hidden]``. It also writes each layer's new K/V into the paged cache at
the step's slots, as the attention backend would.

Contract:

- Values: bitwise those of the per-op native path (``DecoderLayer.forward_fused`` with the native
  products, rope, norms, SiLU and ``NativeCpuAttentionBackend``), in the output and in the cache,
  whatever the thread count (tests/unit/test_native_decoder.py), when the qkv and intermediate widths are
  multiples of 4 (every Llama-family model's are); otherwise equal to rounding.
- ``handles`` says whether a step can take it: any number of tokens (decode steps, prompt chunks and
  mixed steps alike: the packed product and the attention plan take every row count), float32 CPU
  hidden states, a contiguous cache of this model's shape in float32 or quantized (int8, fp8 or int4 with
  its contiguous scales, written and read as ``kernels/cpu_kv_codes.c`` does for the per-op path), and
  the ``NativeCpuAttentionBackend`` prepared for the step (``paged_arrays``). A backend with ``mass``
  (``--kv-eviction``: ``[blocks, layers x kv_heads]``) gets each layer's block scores per KV head added
  in the call, bitwise the per-op path's.
- Weights: the four matrices packed (``NativeOps.pack``, ``NativeOps.qpack`` for a matrix kept in its
  GGUF blocks, or ``NativeOps.pack_bf16``, as the layers' ``PreparedLinear`` holds them, each with its
  ``native_format``; bitwise the same products, the int8-activation and bfloat16 ones included),
  the norms and the bias as they are; the intermediate width a multiple of ``PANEL`` (the products are
  split by whole panels; every Llama-family model's is). The tensors are read in place through pointers
  taken when the decoder is built; it keeps a reference to every tensor, and must be rebuilt when the
  weights are replaced (the model does so in ``prepare_linears``).
- Threads: ``torch.get_num_threads()`` at each call, on torch's OpenMP team.
- Scratch: ``DecoderShape.workspace_floats(tokens)`` floats per call; a workspace of up to
  ``KEEP_WORKSPACE_BYTES`` is kept between calls, a larger one (long prompt chunks) lives for its call
  only, as the per-op path's intermediates would.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kernels.attention import AttentionBackend
from kernels.cpu_native import QUANT_CODES, NativeCpuAttentionBackend, load_library
from kernels.gguf_blocks import BlockKind
from kernels.kv_quant import stored_head_dim
from kernels.native_ops import BF16_FORMAT, INT8_FLAG, PANEL, NativeOps, native_ops

KEEP_WORKSPACE_BYTES = 64 << 20  # scratch kept between calls (a decode step of SmolLM2 needs 29 KB a token)


@dataclass(frozen=True)
class DecoderLayerWeights:
    """One layer's tensors, Llama layout: ``qkv`` rows are q heads, k heads, v heads; ``gate_up`` rows
    are gate, then up; every matrix an ``[out, in]`` weight packed by ``NativeOps.pack``, kept in GGUF
    blocks and packed by ``NativeOps.qpack``, or packed in bfloat16 by ``NativeOps.pack_bf16``, as its
    ``formats_of`` entry says (``PreparedLinear.native_format``: 0, a ``BlockKind`` or ``BF16_FORMAT``, with
    ``INT8_FLAG`` where the product takes int8 activations)."""

    input_norm: torch.Tensor
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    o_proj: torch.Tensor
    post_norm: torch.Tensor
    gate_up: torch.Tensor
    down_proj: torch.Tensor
    formats_of: tuple[int, ...] = (0, 0, 0, 0)  # qkv, o, gate/up, down

    def tensors(self) -> tuple[torch.Tensor | None, ...]:
        """In the order of the C side's per-layer pointer table."""
        return (self.input_norm, self.qkv, self.qkv_bias, self.o_proj, self.post_norm, self.gate_up,
                self.down_proj)

    @property
    def formats(self) -> int:
        """The C side's formats word: one byte per matrix."""
        return sum(fmt << (8 * i) for i, fmt in enumerate(self.formats_of))


@dataclass(frozen=True)
class DecoderShape:
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float

    @property
    def qkv_width(self) -> int:
        return (self.num_heads + 2 * self.num_kv_heads) * self.head_dim

    def workspace_floats(self, tokens: int) -> int:
        """Floats of scratch a step of ``tokens`` rows needs (the layout is the C side's)."""
        per_row = (2 * self.hidden_size + self.qkv_width + self.num_heads * self.head_dim
                   + 3 * self.intermediate_size)
        return tokens * per_row


def _packed(fmt: int, out_features: int, in_features: int) -> tuple[tuple[int, ...], torch.dtype]:
    """The packed tensor's shape and dtype for a matrix of native format ``fmt``."""
    base = fmt & ~INT8_FLAG
    if base == 0:
        return NativeOps.packed_shape(out_features, in_features), torch.float32
    if base == BF16_FORMAT:
        return NativeOps.bf16_shape(out_features, in_features), torch.int16
    ops = native_ops()
    if ops is None:
        raise RuntimeError("native CPU kernel library is unavailable")
    return ops.qpacked_shape(BlockKind(base), out_features, in_features), torch.uint8


class NativeDecoder:
    """The decoder stack as one native call; see the module docstring."""

    def __init__(self, layers: Sequence[DecoderLayerWeights], final_norm: torch.Tensor,
                 shape: DecoderShape) -> None:
        lib = load_library()
        if lib is None:
            raise RuntimeError("native CPU kernel library is unavailable")
        self._call = lib.pdserve_decoder_f32
        self.shape = shape
        s = shape
        if s.intermediate_size % PANEL:
            raise ValueError(f"intermediate size {s.intermediate_size} is not a multiple of {PANEL}")
        matrices = ((s.qkv_width, s.hidden_size), (s.hidden_size, s.num_heads * s.head_dim),
                    (2 * s.intermediate_size, s.hidden_size), (s.hidden_size, s.intermediate_size))
        pointers: list[list[int]] = []
        for i, layer in enumerate(layers):
            packed = [_packed(fmt, *dims) for fmt, dims in zip(layer.formats_of, matrices, strict=True)]
            vector = ((s.hidden_size,), torch.float32)
            expected = (vector, packed[0], ((s.qkv_width,), torch.float32), packed[1], vector, packed[2],
                        packed[3])
            row = []
            for tensor, (want, dtype) in zip(layer.tensors(), expected, strict=True):
                if tensor is None:
                    row.append(0)
                    continue
                if (tensor.dtype != dtype or tensor.device.type != "cpu" or not tensor.is_contiguous()
                        or tuple(tensor.shape) != want):
                    raise ValueError(f"layer {i}: a weight of shape {tuple(tensor.shape)} {tensor.dtype} on "
                                     f"{tensor.device} (contiguous: {tensor.is_contiguous()}); the native "
                                     f"decoder takes a contiguous {dtype} CPU tensor of shape {want} there")
                row.append(tensor.data_ptr())
            row.append(layer.formats)
            pointers.append(row)
        if (final_norm.dtype != torch.float32 or tuple(final_norm.shape) != (s.hidden_size,)
                or not final_norm.is_contiguous()):
            raise ValueError(f"final norm of shape {tuple(final_norm.shape)} {final_norm.dtype}")
        self._layers = list(layers)  # the pointers below stay valid while these live
        self._pointers = torch.tensor(pointers, dtype=torch.int64).reshape(len(pointers), 8)
        self.num_layers = len(pointers)
        self._final_norm = final_norm
        self._work = torch.empty(0, dtype=torch.float32)

    def handles(self, hidden: torch.Tensor, kv_cache: torch.Tensor, backend: AttentionBackend,
                kv_scales: torch.Tensor | None) -> bool:
        """Whether this step can run here (the module docstring's conditions)."""
        s = self.shape
        tokens = hidden.shape[0]
        if tokens < 1:
            return False
        if hidden.dtype != torch.float32 or hidden.device.type != "cpu" or not hidden.is_contiguous():
            return False
        if kv_cache.device.type != "cpu" or not kv_cache.is_contiguous() or kv_cache.dim() != 6:
            return False
        if kv_scales is None and kv_cache.dtype != torch.float32:
            return False
        if kv_scales is not None and (kv_cache.dtype not in QUANT_CODES or not kv_scales.is_contiguous()
                                      or kv_scales.device.type != "cpu"):
            return False
        layers, _, two, block_size, kv_heads, stored = kv_cache.shape
        if (layers, two, kv_heads, stored) != (self.num_layers, 2, s.num_kv_heads,
                                               stored_head_dim(kv_cache.dtype, s.head_dim)):
            return False
        if block_size & (block_size - 1) or s.head_dim % 16 or s.head_dim > 256:
            return False
        if not isinstance(backend, NativeCpuAttentionBackend):
            return False
        arrays = backend.paged_arrays()
        return arrays is not None and arrays[0].block_size == block_size and arrays[0].num_tokens == tokens

    def run(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor,
            backend: AttentionBackend, kv_scales: torch.Tensor | None = None) -> torch.Tensor:
        """Final-normed hidden states ``[T, hidden]``; ``hidden`` (the embeddings) is used as scratch and
        the step's K/V are written into ``kv_cache``. The caller checked ``handles``."""
        arrays = backend.paged_arrays() if isinstance(backend, NativeCpuAttentionBackend) else None
        mass = backend.mass if isinstance(backend, NativeCpuAttentionBackend) else None
        if arrays is None:
            raise RuntimeError("the native decoder needs the native attention backend, prepared for the step")
        if mass is not None and mass.shape[1] != self.num_layers * self.shape.num_kv_heads:
            raise ValueError(f"attention mass of {mass.shape[1]} columns for {self.num_layers} layers of "
                             f"{self.shape.num_kv_heads} KV heads")
        meta, write_rows, query_start_loc, seq_lens, block_tables = arrays
        s = self.shape
        tokens = hidden.shape[0]
        if meta.num_tokens != tokens or write_rows.shape[0] != tokens:
            raise ValueError(f"{tokens} hidden rows for a step of {meta.num_tokens} tokens")
        cos, sin = cos.contiguous(), sin.contiguous()
        need = s.workspace_floats(tokens)
        work = self._work
        if work.numel() < need:
            work = torch.empty(need, dtype=torch.float32)
            if need * 4 <= KEEP_WORKSPACE_BYTES:
                self._work = work
        out = torch.empty_like(hidden)
        width = block_tables.shape[1] if block_tables.dim() == 2 else 0
        status = self._call(
            self._pointers.data_ptr(), self.num_layers, kv_cache.data_ptr(),
            kv_cache[0].numel() * kv_cache.element_size(),
            0 if kv_scales is None else QUANT_CODES[kv_cache.dtype],
            None if kv_scales is None else kv_scales.data_ptr(),
            0 if kv_scales is None else kv_scales[0].numel(),
            hidden.data_ptr(), out.data_ptr(), work.data_ptr(), cos.data_ptr(), sin.data_ptr(),
            write_rows.data_ptr(), query_start_loc.data_ptr(), seq_lens.data_ptr(), block_tables.data_ptr(),
            meta.num_seqs, width, tokens,
            s.hidden_size, s.num_heads, s.num_kv_heads, s.head_dim, s.intermediate_size, meta.block_size,
            s.head_dim**-0.5, s.rms_norm_eps, self._final_norm.data_ptr(),
            None if mass is None else mass.data_ptr(), torch.get_num_threads(),
        )
        if status != 0:
            raise RuntimeError(f"native decoder failed with code {status}")
        return out

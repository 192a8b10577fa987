"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM2) over a paged KV cache.

Weights are stored fused: per layer one ``qkv`` matrix (rows: q heads, then k
heads, then v heads) and one ``gate_up`` matrix (rows: gate, then up), so a
layer runs four matmuls. ``load_weights`` takes Hugging Face parameter names and
fills the fused tensors by row slices; every parameter must arrive exactly once
with exactly its expected shape. Once loaded, each matrix is wrapped in a
``kernels.linear.PreparedLinear`` (packed for the model's ``linear_kernel``);
the forward runs through those, so weights changed after ``load_weights`` must
be followed by ``prepare_linears()``.

Tensor parallelism (``engine/tensor_parallel.py``): built with a ``TpShard`` of size N and its ``TpGroup``,
the model holds one rank's shard (its query and KV heads, its MLP columns, its vocabulary rows); the
row-parallel products and the embedding are summed over the group, the logits gathered to rank 0.
``load_weights`` takes either whole Hugging Face tensors (each is cut to the shard) or tensors a loader
already cut (``ModelSource.iter_weights(shard)``): a tensor of the shard's shape is taken as it is.

Fused small ops: on float32 CPU, with the native kernels built (``kernels/native_ops.py``), the forward
runs ``DecoderLayer.forward_fused``: each residual add is done in place together with the norm after it
(the last layer's with the final norm), rope rotates q and k in place in the QKV product's output, and
SiLU*up is one call. Same values as the torch path up to the norm's and SiLU's rounding;
``use_native_ops`` (or ``PDSERVE_NATIVE_KERNELS=0``) turns it off. Steps whose products all take the native
kernel (every row count) go further: every layer and the final norm in one
native call (``kernels/native_decoder.py``), bitwise the values of the per-layer fused path;
``use_native_decoder`` (default: on unless ``PDSERVE_NATIVE_DECODER=0``) turns that off alone.

Greedy rows: ``greedy_tokens`` picks each row's argmax of the LM head without the whole float32 product
where ``kernels/greedy_head.py`` applies (the native float32 LM head on one rank), bitwise the tokens
``compute_logits(...).argmax(-1)`` gives.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import ModelConfig
from engine.tensor_parallel import TpShard
from engine.tp_group import TpGroup
from kernels.activation import silu_mul
from kernels.attention import AttentionBackend, AttentionMetadata
from kernels.cpu_native import env_off
from kernels.greedy_head import GreedyHead
from kernels.linear import LinearKernel, PreparedLinear
from kernels.native_decoder import DecoderLayerWeights, DecoderShape, NativeDecoder
from kernels.native_ops import PANEL, NativeOps, native_ops
from kernels.norm import rms_norm
from kernels.rope import RotaryEmbedding, apply_rotary

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


def allocate_kv_cache(
    config: ModelConfig,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
) -> torch.Tensor:
    """Zeros of shape ``[num_layers, num_blocks, 2, block_size, num_kv_heads, head_dim]``."""
    shape = (config.num_layers, num_blocks, 2, block_size, config.num_kv_heads, config.head_dim)
    return torch.zeros(shape, dtype=dtype, device=device)


def allocate_kv_scales(config: ModelConfig, num_blocks: int, device: torch.device | str) -> torch.Tensor:
    """Ones of shape ``[num_layers, num_blocks, 2, num_kv_heads]`` float32 (``kernels/kv_quant.py``)."""
    shape = (config.num_layers, num_blocks, 2, config.num_kv_heads)
    return torch.ones(shape, dtype=torch.float32, device=device)


def _weight(*shape: int, dtype: torch.dtype, device: torch.device | str) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


def _released(param: torch.Tensor) -> bool:
    """Whether ``param`` is a released matrix's zero-stride stand-in (``DecoderLayer.release_plain``)."""
    return param.dim() == 2 and param.numel() > 1 and param.stride() == (0, 0)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str,
                 shard: TpShard | None = None, group: TpGroup | None = None) -> None:
        super().__init__()
        c = config
        shard = shard or TpShard(config)
        self.group = group if shard.size > 1 else None
        self.num_heads = shard.num_heads
        self.num_kv_heads = shard.num_kv_heads
        self.head_dim = c.head_dim
        self.eps = c.rms_norm_eps
        self.scale = c.head_dim**-0.5
        qkv_rows = (self.num_heads + 2 * self.num_kv_heads) * c.head_dim
        inter = shard.intermediate_size
        self.input_norm = _weight(c.hidden_size, dtype=dtype, device=device)
        self.qkv = _weight(qkv_rows, c.hidden_size, dtype=dtype, device=device)
        self.qkv_bias = _weight(qkv_rows, dtype=dtype, device=device) if c.attention_bias else None
        self.o_proj = _weight(c.hidden_size, self.num_heads * c.head_dim, dtype=dtype, device=device)
        self.post_norm = _weight(c.hidden_size, dtype=dtype, device=device)
        self.gate_up = _weight(2 * inter, c.hidden_size, dtype=dtype, device=device)
        self.down_proj = _weight(c.hidden_size, inter, dtype=dtype, device=device)
        self.prepare_linears("plain")

    def _reduce(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(x) if self.group is not None else x

    def prepare_linears(self, kernel: LinearKernel, keep_plain: bool = False) -> None:
        """(Re)build the prepared products from the current weights. The native kernel's products hold
        the packed copy only: unless ``keep_plain``, the ``[out, in]`` matrices are then released
        (``release_plain``)."""
        if hasattr(self, "qkv_linear"):  # not the first build: the matrices may be released
            self.restore_plain()
        self.qkv_linear = PreparedLinear(self.qkv, self.qkv_bias, kernel)
        self.o_linear = PreparedLinear(self.o_proj, None, kernel)
        self.gate_up_linear = PreparedLinear(self.gate_up, None, kernel)
        self.down_linear = PreparedLinear(self.down_proj, None, kernel)
        if not keep_plain:
            self.release_plain()

    def _matrices(self) -> list[tuple[nn.Parameter, PreparedLinear]]:
        return [(self.qkv, self.qkv_linear), (self.o_proj, self.o_linear),
                (self.gate_up, self.gate_up_linear), (self.down_proj, self.down_linear)]

    def release_plain(self) -> None:
        """Free the ``[out, in]`` matrices whose product holds a packed copy (one copy of the weights in
        memory, not two): each becomes a zero-stride stand-in of its shape (4 bytes) until
        ``restore_plain``."""
        for param, linear in self._matrices():
            if linear.packed is not None and not _released(param):
                param.data = torch.zeros((), dtype=param.dtype, device=param.device).expand(param.shape)
                linear.release_weight(param.data)

    def restore_plain(self) -> None:
        """The ``[out, in]`` matrices back from the packed copies, bitwise (loading weights, another
        kernel and the compiled path read them)."""
        for param, linear in self._matrices():
            if linear.packed is not None and _released(param):
                param.data = NativeOps.unpack(linear.packed, param.shape[0])
                linear.weight = param.data

    @property
    def plain_released(self) -> bool:
        """Whether any ``[out, in]`` matrix is released (a zero-stride stand-in)."""
        return any(_released(param) for param, _ in self._matrices())

    def native_weights(self) -> DecoderLayerWeights | None:
        """The layer's tensors for the one-call decoder, or None where a product holds no packed copy."""
        qkv, o, gate_up, down = (linear.packed for _, linear in self._matrices())
        if qkv is None or o is None or gate_up is None or down is None:
            return None
        bias = None if self.qkv_bias is None else self.qkv_bias.data
        return DecoderLayerWeights(self.input_norm.data, qkv, bias, o, self.post_norm.data, gate_up, down)

    def hf_targets(self, prefix: str) -> dict[str, torch.Tensor]:
        """Hugging Face name -> the (view of the) tensor it fills."""
        self.restore_plain()
        q = self.num_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        inter = self.gate_up.shape[0] // 2
        targets = {
            f"{prefix}.input_layernorm.weight": self.input_norm.data,
            f"{prefix}.self_attn.q_proj.weight": self.qkv.data[:q],
            f"{prefix}.self_attn.k_proj.weight": self.qkv.data[q : q + kv],
            f"{prefix}.self_attn.v_proj.weight": self.qkv.data[q + kv :],
            f"{prefix}.self_attn.o_proj.weight": self.o_proj.data,
            f"{prefix}.post_attention_layernorm.weight": self.post_norm.data,
            f"{prefix}.mlp.gate_proj.weight": self.gate_up.data[:inter],
            f"{prefix}.mlp.up_proj.weight": self.gate_up.data[inter:],
            f"{prefix}.mlp.down_proj.weight": self.down_proj.data,
        }
        if self.qkv_bias is not None:
            bias = self.qkv_bias.data
            targets[f"{prefix}.self_attn.q_proj.bias"] = bias[:q]
            targets[f"{prefix}.self_attn.k_proj.bias"] = bias[q : q + kv]
            targets[f"{prefix}.self_attn.v_proj.bias"] = bias[q + kv :]
        return targets

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_layer: torch.Tensor,
        backend: AttentionBackend,
        kv_scales: torch.Tensor | None = None,
    ) -> torch.Tensor:
        tokens = hidden.shape[0]
        h, kv_h = self.num_heads, self.num_kv_heads
        x = rms_norm(hidden, self.input_norm, self.eps)
        qkv = self.qkv_linear(x).view(tokens, h + 2 * kv_h, self.head_dim)
        qk = apply_rotary(qkv[:, : h + kv_h], cos, sin)
        attn = backend.forward(qk[:, :h], qk[:, h:], qkv[:, h + kv_h :], kv_layer, self.scale, kv_scales)
        hidden = hidden + self._reduce(self.o_linear(attn.reshape(tokens, h * self.head_dim)))
        x = rms_norm(hidden, self.post_norm, self.eps)
        return hidden + self._reduce(self.down_linear(silu_mul(self.gate_up_linear(x))))

    def forward_fused(
        self,
        hidden: torch.Tensor,
        delta: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_layer: torch.Tensor,
        backend: AttentionBackend,
        ops: NativeOps,
        kv_scales: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward`` with the residual adds deferred: the layer's input is ``hidden + delta`` (``delta``
        None: ``hidden``), and it returns ``(residual, delta)`` whose sum is its output. ``hidden`` is
        updated in place."""
        tokens = hidden.shape[0]
        h, kv_h = self.num_heads, self.num_kv_heads
        x = ops.add_rms_norm(hidden, delta, self.input_norm, self.eps)
        qkv = self.qkv_linear(x).view(tokens, h + 2 * kv_h, self.head_dim)
        ops.rope_(qkv, cos, sin, h + kv_h)
        attn = backend.forward(qkv[:, :h], qkv[:, h : h + kv_h], qkv[:, h + kv_h :], kv_layer, self.scale,
                               kv_scales)
        x = ops.add_rms_norm(hidden, self._reduce(self.o_linear(attn.reshape(tokens, h * self.head_dim))),
                             self.post_norm, self.eps)
        return hidden, self._reduce(self.down_linear(ops.silu_mul(self.gate_up_linear(x))))


class CausalLM(nn.Module):
    """Decoder-only LM; ``forward`` returns final-normed hidden states, ``compute_logits`` the scores."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str = "cpu",
                 linear_kernel: LinearKernel = "native", shard: TpShard | None = None,
                 group: TpGroup | None = None) -> None:
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.linear_kernel: LinearKernel = linear_kernel
        self.shard = shard or TpShard(config)
        if self.shard.size > 1 and group is None:
            raise ValueError(f"a tensor-parallel shard of {self.shard.size} ranks needs its TpGroup")
        self.group = group if self.shard.size > 1 else None
        vocab = self.shard.vocab_per_rank
        self.embed_tokens = _weight(vocab, config.hidden_size, dtype=dtype, device=device)
        if self.group is not None:  # the padded tail rows of the last vocabulary shard stay zero
            self.embed_tokens.data.zero_()
        self.layers = nn.ModuleList(DecoderLayer(config, dtype, device, self.shard, group)
                                    for _ in range(config.num_layers))
        self.norm = _weight(config.hidden_size, dtype=dtype, device=device)
        self.lm_head = self.embed_tokens
        if not config.tie_word_embeddings:
            self.lm_head = _weight(vocab, config.hidden_size, dtype=dtype, device=device)
            self.lm_head.data.zero_()
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling, device)
        self.lm_head_linear = PreparedLinear(self.lm_head, None, "plain")
        self.greedy_head: GreedyHead | None = None
        self.use_native_ops = True
        self.use_native_decoder = not env_off("PDSERVE_NATIVE_DECODER")
        self.native_decoder: NativeDecoder | None = None
        # keep the decoder's [out, in] matrices beside the native packed copies (the compiled path reads them)
        self.keep_plain_weights = False

    def prepare_linears(self, kernel: LinearKernel | None = None) -> None:
        """Pack every matrix for ``kernel`` (default: ``linear_kernel``) from the current weights."""
        if kernel is not None:
            self.linear_kernel = kernel
        for layer in self.layers:
            assert isinstance(layer, DecoderLayer)
            layer.prepare_linears(self.linear_kernel, keep_plain=self.keep_plain_weights)
        self.lm_head_linear = PreparedLinear(self.lm_head, None, self.linear_kernel)
        self.greedy_head = GreedyHead.build(self.lm_head_linear) if self.group is None else None
        self.native_decoder = self._build_native_decoder()

    def restore_plain_weights(self) -> None:
        """Keep every layer's ``[out, in]`` matrices from now on (``keep_plain_weights``): the compiled
        decode path reads them."""
        self.keep_plain_weights = True
        for layer in self.layers:
            assert isinstance(layer, DecoderLayer)
            layer.restore_plain()

    def _build_native_decoder(self) -> NativeDecoder | None:
        """The one-call decoder over the current weights, when every product is the native one."""
        layers = [layer for layer in self.layers if isinstance(layer, DecoderLayer)]
        found = [layer.native_weights() for layer in layers]
        weights = [w for w in found if w is not None]
        if (self.group is not None or native_ops() is None or self.dtype != torch.float32
                or len(weights) != len(found) or self.shard.intermediate_size % PANEL):
            return None
        c = self.config
        shape = DecoderShape(c.hidden_size, self.shard.num_heads, self.shard.num_kv_heads, c.head_dim,
                             self.shard.intermediate_size, c.rms_norm_eps)
        return NativeDecoder(weights, self.norm.data, shape)

    def _hf_targets(self) -> dict[str, torch.Tensor]:
        start, stop = self.shard.vocab_range
        targets = {"model.embed_tokens.weight": self.embed_tokens.data[: stop - start],
                   "model.norm.weight": self.norm.data}
        if not self.config.tie_word_embeddings:
            targets["lm_head.weight"] = self.lm_head.data[: stop - start]
        for i, layer in enumerate(self.layers):
            assert isinstance(layer, DecoderLayer)
            targets.update(layer.hf_targets(f"model.layers.{i}"))
        return targets

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors in, cast to the model dtype.

        Raises ``ValueError`` naming the first unexpected, duplicated or
        mis-shaped parameter, or every missing one. With tied embeddings a
        ``lm_head.weight`` is accepted and ignored (state dicts carry it).
        """
        targets = self._hf_targets()
        loaded: set[str] = set()
        for name, tensor in weights:
            if name.endswith(_IGNORED_SUFFIXES):
                continue
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            target = targets.get(name)
            if target is None:
                raise ValueError(f"unexpected parameter {name!r} for a {self.config.architecture} model")
            if name in loaded:
                raise ValueError(f"parameter {name!r} given twice")
            cut = self.shard.weight_slice(name) if self.shard.size > 1 else None
            if (cut is not None and tuple(tensor.shape) != tuple(target.shape) and tensor.dim() > cut.dim
                    and tensor.shape[cut.dim] >= cut.stop):  # a whole tensor: cut this rank's part
                tensor = cut.take(tensor)
            if tuple(tensor.shape) != tuple(target.shape):
                raise ValueError(
                    f"parameter {name!r} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}"
                )
            target.copy_(tensor.to(device=target.device, dtype=target.dtype))
            loaded.add(name)
        missing = sorted(set(targets) - loaded)
        if missing:
            shown = ", ".join(missing[:8]) + (f" (and {len(missing) - 8} more)" if len(missing) > 8 else "")
            raise ValueError(f"missing parameters: {shown}")
        self.prepare_linears()

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        backend: AttentionBackend,
        meta: AttentionMetadata,
        kv_scales: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` (final norm applied); ``backend.prepare(meta)`` already ran.

        ``kv_scales`` (``[num_layers, num_blocks, 2, kv_heads]``) goes with a quantized ``kv_cache``.
        """
        if input_ids.shape[0] != meta.num_tokens:
            raise ValueError(f"got {input_ids.shape[0]} tokens but the metadata describes {meta.num_tokens}")
        hidden = self._embed(input_ids)
        cos, sin = self.rotary.cos_sin(positions, self.dtype)
        ops = native_ops() if self.use_native_ops else None
        decoder = self.native_decoder if self.use_native_decoder and ops is not None else None
        if decoder is not None and decoder.handles(hidden, kv_cache, backend, kv_scales):
            return decoder.run(hidden, cos, sin, kv_cache, backend)
        if ops is not None and ops.usable(hidden, cos):
            delta: torch.Tensor | None = None
            for i, layer in enumerate(self.layers):
                assert isinstance(layer, DecoderLayer)
                scales = kv_scales[i] if kv_scales is not None else None
                hidden, delta = layer.forward_fused(hidden, delta, cos, sin, kv_cache[i], backend, ops,
                                                    scales)
            return ops.add_rms_norm(hidden, delta, self.norm, self.config.rms_norm_eps)
        for i, layer in enumerate(self.layers):
            scales = kv_scales[i] if kv_scales is not None else None
            hidden = layer(hidden, cos, sin, kv_cache[i], backend, scales)
        return rms_norm(hidden, self.norm, self.config.rms_norm_eps)

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.group is None:
            return F.embedding(input_ids, self.embed_tokens)
        start, stop = self.shard.vocab_range
        outside = (input_ids < start) | (input_ids >= stop)
        rows = F.embedding((input_ids - start).masked_fill(outside, 0), self.embed_tokens)
        return self.group.all_reduce(rows.masked_fill(outside.unsqueeze(-1), 0.0))

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Each row's argmax of ``compute_logits(hidden)`` (int64 ``[N]``), bitwise the token the full
        product picks, computed without it (``kernels/greedy_head.py``); None where that does not apply
        (then take ``compute_logits``)."""
        return None if self.greedy_head is None else self.greedy_head.argmax(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits ``[N, vocab]`` in float32 (with tensor parallelism: on rank 0; the others get their
        own shard's columns, which nobody reads)."""
        logits = self.lm_head_linear(hidden).float()
        if self.group is None:
            return logits
        if not hidden.shape[0]:  # a step that samples nothing (every rank knows): no gather
            return logits.new_empty(0, self.config.vocab_size)
        gathered = self.group.gather_columns(logits)
        return gathered[:, : self.config.vocab_size] if self.shard.rank == 0 else gathered

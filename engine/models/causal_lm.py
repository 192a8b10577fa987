"""``CausalLM``: the decoder of any registered family over a paged KV cache.

Built from the layer library (``engine/layers/``) for the family ``config.architecture`` names
(``engine/models/registry.py``): the embedding (times ``sqrt(hidden_size)`` for Gemma), one
``DecoderLayer`` per layer, the final norm and the LM head (tied to the embedding or not; Gemma's
final logits may be soft-capped). ``load_weights`` (``engine/models/weight_load.py``, with the keeping
of quantized blocks) takes Hugging Face parameter names (the family maps
its checkpoint's names onto the library's first) and fills the fused tensors by row slices; every
parameter must arrive exactly once with exactly its expected shape. Once loaded, each matrix is wrapped
in a ``kernels.linear.PreparedLinear`` (packed for the model's ``linear_kernel``); weights changed
after ``load_weights`` must be followed by ``prepare_linears()``.

Tensor parallelism (``engine/tensor_parallel.py``): built with a ``TpShard`` of size N and its
``TpGroup``, the model holds one rank's shard (its query and KV heads, its MLP and experts' columns,
its vocabulary rows); the row-parallel products and the embedding are summed over the group, the
logits gathered to rank 0. ``load_weights`` takes either whole tensors (each is cut to the shard) or
tensors a loader already cut (``ModelSource.iter_weights(shard)``): a tensor of the shard's shape is
taken as it is.

Execution paths, decided when the weights are prepared (``execution_path`` says which, and the engine
logs it once): a model whose layers are all ``fusable`` (plain Llama, ``engine/layers/decoder.py``)
runs the fused native ops on float32 CPU, and, when every product is the native packed one, every
layer and the final norm in one native call (``kernels/native_decoder.py``; ``use_native_decoder``,
``EngineConfig.native_decoder``). Any other model runs each layer's ``forward`` (its products still
the prepared ones).

Greedy rows: ``greedy_tokens`` picks each row's argmax of the LM head without the whole float32 product
where ``kernels/greedy_head.py`` applies (the native float32 LM head on one rank), bitwise the tokens
``compute_logits(...).argmax(-1)`` gives (a final softcap is monotonic: it changes no argmax).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import GGUF_ACTIVATIONS, ModelConfig, RopeScaling
from engine.kv_groups import KvGroup, layer_slots
from engine.layers.attention import Attention
from engine.layers.context import LayerContext
from engine.layers.decoder import DecoderLayer
from engine.layers.moe import MoE
from engine.layers.prepared import released, weight
from engine.models.registry import family
from engine.models.weight_load import WeightLoading
from engine.tensor_parallel import TpShard
from engine.tp_group import TpGroup
from kernels.attention import AttentionBackend, AttentionMetadata
from kernels.gguf_blocks import BlockMatrix
from kernels.greedy_head import GreedyHead
from kernels.linear import LinearKernel, PreparedLinear
from kernels.native_decoder import DecoderShape, NativeDecoder
from kernels.native_ops import PANEL, native_ops
from kernels.norm import rms_norm, rms_norm_offset
from kernels.rope import RotaryEmbedding


class CausalLM(WeightLoading, nn.Module):
    """Decoder-only LM; ``forward`` returns final-normed hidden states, ``compute_logits`` the scores."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str = "cpu",
                 linear_kernel: LinearKernel = "native", shard: TpShard | None = None,
                 group: TpGroup | None = None) -> None:
        super().__init__()
        self.config = config
        self.family = family(config.architecture)
        self.dtype = dtype
        self.linear_kernel: LinearKernel = linear_kernel
        self.shard = shard or TpShard(config)
        if self.shard.size > 1 and group is None:
            raise ValueError(f"a tensor-parallel shard of {self.shard.size} ranks needs its TpGroup")
        self.group = group if self.shard.size > 1 else None
        self.norm_fn = rms_norm_offset if self.family.norm_offset else rms_norm
        ctx = LayerContext(config, dtype, device, self.shard, self.group, self.norm_fn)
        vocab = self.shard.vocab_per_rank
        self.embed_tokens = weight(vocab, config.hidden_size, dtype=dtype, device=device)
        if self.group is not None:  # the padded tail rows of the last vocabulary shard stay zero
            self.embed_tokens.data.zero_()
        self.embed_scale = (torch.tensor(config.hidden_size**0.5, dtype=dtype)
                            if self.family.embed_scale else None)
        self.layers = nn.ModuleList(DecoderLayer(ctx, i, self.family.sandwich_norms)
                                    for i in range(config.num_layers))
        self.norm = weight(config.hidden_size, dtype=dtype, device=device)
        self.lm_head = self.embed_tokens
        if not config.tie_word_embeddings:
            self.lm_head = weight(vocab, config.hidden_size, dtype=dtype, device=device)
            self.lm_head.data.zero_()
        rope_dim = config.mla.qk_rope_head_dim if config.mla is not None else config.head_dim
        self.rotaries = [RotaryEmbedding(rope_dim, config.rope_theta, config.rope_scaling, device)]
        if config.local_rope_theta is not None:
            local = RotaryEmbedding(config.head_dim, config.local_rope_theta, RopeScaling(), device)
            self.rotaries.append(local)
        self.lm_head_linear = PreparedLinear(self.lm_head, None, "plain")
        # the embedding and head kept in GGUF blocks (``takes_blocks``); None: the tables hold floats
        self.embed_blocks: BlockMatrix | None = None
        self.head_blocks: BlockMatrix | None = None
        self.greedy_head: GreedyHead | None = None
        self.use_native_ops = True
        self.use_native_decoder = True
        self.use_greedy_head = True
        # the products over GGUF blocks: "float32" or "int8" activations (EngineConfig.gguf_activations;
        # prepare_linears applies it)
        self.gguf_activations = "float32"
        # every native float product in bfloat16 (``--dtype bfloat16`` on CPU, EngineConfig.bf16_products;
        # prepare_linears applies it): the weights stored in bfloat16, the activations rounded at each input
        self.bf16_products = False
        self.native_decoder: NativeDecoder | None = None
        # keep the decoder's [out, in] matrices beside the native packed copies (the compiled path reads them)
        self.keep_plain_weights = False
        # each layer's KV group and slot of the cache tensor (``set_kv_groups``); one group: slot = layer
        self.group_of = [0] * config.num_layers
        self.slot_of = list(range(config.num_layers))

    def set_kv_groups(self, groups: tuple[KvGroup, ...]) -> None:
        """Read layer ``l``'s K/V from ``kv_cache[slot]`` through its group's backend
        (``engine/kv_groups.py``)."""
        self.group_of, self.slot_of = layer_slots(groups, self.config.num_layers)

    @property
    def rotary(self) -> RotaryEmbedding:
        """The rotary embedding of the full-attention layers (every layer's but Gemma's local ones)."""
        return self.rotaries[0]

    def decoder_layers(self) -> list[DecoderLayer]:
        return [layer for layer in self.layers if isinstance(layer, DecoderLayer)]

    @property
    def fusable(self) -> bool:
        """Whether every layer is plain Llama (the fused native paths compute them all)."""
        return (self.embed_scale is None and self.linear_kernel != "triton"
                and all(layer.fusable for layer in self.decoder_layers()))

    @property
    def execution_path(self) -> str:
        """Which path the forward takes on this model, in words (logged once by the engine)."""
        products = ", bfloat16 products" if self.bf16_products else ""
        if self.native_decoder is not None and self.use_native_decoder:
            return f"one native call per step (every layer fused{products})"
        if self.fusable and native_ops() is not None and self.dtype == torch.float32:
            return f"fused native ops per layer{products}"
        kinds = sorted({reason for layer in self.decoder_layers() for reason in _unfused(layer)})
        if any(lin.triton for lin in self.prepared_linears()):
            products += ", Triton products over the kept blocks"
        return "per-layer" + (f" ({', '.join(kinds)})" if kinds else "") + products

    def prepare_linears(self, kernel: LinearKernel | None = None) -> None:
        """Pack every matrix for ``kernel`` (default: ``linear_kernel``) from the current weights."""
        if kernel is not None:
            self.linear_kernel = kernel
        for layer in self.decoder_layers():
            layer.prepare_linears(self.linear_kernel, keep_plain=self.keep_plain_weights,
                                  bf16=self.bf16_products)
        self.lm_head_linear = PreparedLinear(self.lm_head, None, self.linear_kernel, self.head_blocks)
        if self.bf16_products:
            self._round_to_bf16()
        if self.head_blocks is not None and self.lm_head_linear.kind is None:  # no native product: floats
            self._fill_embedding()
        for param, blocks in ((self.embed_tokens, self.embed_blocks), (self.lm_head, self.head_blocks)):
            if blocks is not None and not released(param):  # the blocks stand for this table
                param.data = torch.zeros((), dtype=param.dtype, device=param.device).expand(param.shape)
        if self.lm_head_linear.kind is not None:
            self.lm_head_linear.release_weight(self.lm_head.data)
        for linear in self.prepared_linears():
            linear.set_int8_activations(self.gguf_activations == "int8")
        # a head in blocks or in bfloat16 reads no more bytes than the screen's half-precision copy: no screen
        screened = (self.group is None and self.use_greedy_head and self.lm_head_linear.kind is None
                    and not self.lm_head_linear.bf16)
        self.greedy_head = GreedyHead.build(self.lm_head_linear) if screened else None
        self.native_decoder = self._build_native_decoder()

    def _round_to_bf16(self) -> None:
        """``bf16_products``: the LM head's product in bfloat16, and the embedding table rounded to
        bfloat16 values in place (kept in float32: rows are gathered, not multiplied). Norms and biases
        stay float32, as the activations do."""
        self.lm_head_linear.to_bf16()
        for param in (self.embed_tokens, self.lm_head):
            if not released(param) and param.dtype == torch.float32:
                param.data.copy_(param.data.bfloat16())

    def set_gguf_activations(self, mode: str) -> None:
        """The products over kept GGUF blocks from now on take ``mode`` activations (``float32`` or ``int8``;
        both read the same packed records, so nothing is packed again); the one-call decoder is rebuilt."""
        if mode not in GGUF_ACTIVATIONS:
            raise ValueError(f"gguf activations must be one of {', '.join(GGUF_ACTIVATIONS)}, not {mode!r}")
        self.gguf_activations = mode
        for linear in self.prepared_linears():
            linear.set_int8_activations(mode == "int8")
        self.native_decoder = self._build_native_decoder()

    def _fill_embedding(self) -> None:
        """The embedding and head tables as floats from their blocks (which are then forgotten)."""
        for param, blocks in ((self.embed_tokens, self.embed_blocks), (self.lm_head, self.head_blocks)):
            if blocks is not None:
                param.data = blocks.dequantize().to(device=param.device, dtype=param.dtype)
        if self.config.tie_word_embeddings:
            self.lm_head = self.embed_tokens
        self.embed_blocks = self.head_blocks = None
        self.lm_head_linear = PreparedLinear(self.lm_head, None, self.linear_kernel)

    def restore_plain_weights(self) -> None:
        """Keep every layer's ``[out, in]`` matrices from now on (``keep_plain_weights``): the compiled
        decode path reads them."""
        self.keep_plain_weights = True
        for layer in self.decoder_layers():
            layer.restore_plain()
        if self.embed_blocks is not None or self.head_blocks is not None:
            self._fill_embedding()
            self.greedy_head = None

    def _build_native_decoder(self) -> NativeDecoder | None:
        """The one-call decoder over the current weights, when every layer is fusable and every product
        the native one."""
        if not self.fusable:
            return None
        found = [layer.native_weights() for layer in self.decoder_layers()]
        weights = [w for w in found if w is not None]
        if (self.group is not None or native_ops() is None or self.dtype != torch.float32
                or len(weights) != len(found) or self.shard.intermediate_size % PANEL):
            return None
        c = self.config
        shape = DecoderShape(c.hidden_size, self.shard.num_heads, self.shard.num_kv_heads, c.head_dim,
                             self.shard.intermediate_size, c.rms_norm_eps)
        return NativeDecoder(weights, self.norm.data, shape)

    def weight_bytes(self) -> int:
        """Bytes the model's weights hold in memory: each storage once, among the parameters (a released
        matrix's stand-in is 4 bytes), the prepared products' packed copies, the greedy head's half copy
        and the embedding's GGUF blocks."""
        tensors: list[torch.Tensor] = [p.data for p in self.parameters()]
        tensors += [t for lin in self.prepared_linears() for t in (lin.weight, lin.packed, lin.packed_row)
                    if t is not None]
        if self.greedy_head is not None:
            tensors.append(self.greedy_head.half)
        tensors += [b.rows for b in (self.embed_blocks, self.head_blocks) if b is not None]
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
        return sum(storages.values())

    def prepared_linears(self) -> list[PreparedLinear]:
        """Every product the model holds: the LM head's, then its modules' (an expert list's each)."""
        linears: list[PreparedLinear] = [self.lm_head_linear]
        for module in self.modules():
            for value in vars(module).values():
                found = value if isinstance(value, list) else [value]
                linears += [lin for lin in found if isinstance(lin, PreparedLinear)]
        return linears

    @property
    def int8_activations(self) -> bool:
        """Whether some product takes int8 activations (``gguf_activations`` int8 over kept blocks): the
        model's numerics, which a KV transfer's peers must share (``transfer/compat.py``)."""
        return any(lin.int8_activations for lin in self.prepared_linears())

    @property
    def numerics(self) -> str:
        """The arithmetic of the model's products, which a KV transfer's peers must share
        (``transfer/compat.py``): ``int8`` (int8 activations over GGUF blocks), ``bf16``
        (``bf16_products``) or ``float32``."""
        if self.int8_activations:
            return "int8"
        return "bf16" if self.bf16_products else "float32"

    @property
    def host_synced(self) -> bool:
        """Whether a forward reads device values on the host: a mixture whose experts are kept as records
        routes its tokens on the host to take one expert's products at a time (``MoE.triton_experts``)."""
        return any(isinstance(layer.mlp, MoE) and layer.mlp.triton_experts for layer in self.decoder_layers())

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        backend: AttentionBackend | Sequence[AttentionBackend],
        meta: AttentionMetadata,
        kv_scales: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` (final norm applied); ``backend.prepare(meta)`` already ran (with
        several KV groups: ``backend`` is one per group, each prepared for its group's tables).

        ``kv_scales`` (``[slots, num_blocks, 2, kv_heads]``) goes with a quantized ``kv_cache``.
        """
        if input_ids.shape[0] != meta.num_tokens:
            raise ValueError(f"got {input_ids.shape[0]} tokens but the metadata describes {meta.num_tokens}")
        hidden = self._embed(input_ids)
        ropes = [rotary.cos_sin(positions, self.dtype) for rotary in self.rotaries]
        cos, sin = ropes[0]
        layers = self.decoder_layers()
        backends = [backend] if not isinstance(backend, Sequence) else list(backend)
        if len(backends) > 1:
            for i, layer in enumerate(layers):
                slot = self.slot_of[i]
                scales = kv_scales[slot] if kv_scales is not None else None
                layer_cos, layer_sin = ropes[layer.attn.rope]
                group_backend = backends[self.group_of[i]]
                hidden = layer(hidden, layer_cos, layer_sin, kv_cache[slot], group_backend, scales)
            return self.norm_fn(hidden, self.norm, self.config.rms_norm_eps)
        backend = backends[0]
        ops = native_ops() if self.use_native_ops and self.fusable else None
        decoder = self.native_decoder if self.use_native_decoder and ops is not None else None
        if decoder is not None and decoder.handles(hidden, kv_cache, backend, kv_scales):
            return decoder.run(hidden, cos, sin, kv_cache, backend, kv_scales)
        if ops is not None and ops.usable(hidden, cos):
            delta: torch.Tensor | None = None
            for i, layer in enumerate(layers):
                scales = kv_scales[i] if kv_scales is not None else None
                hidden, delta = layer.forward_fused(hidden, delta, cos, sin, kv_cache[i], backend, ops,
                                                    scales)
            return ops.add_rms_norm(hidden, delta, self.norm, self.config.rms_norm_eps)
        for i, layer in enumerate(layers):
            scales = kv_scales[i] if kv_scales is not None else None
            layer_cos, layer_sin = ropes[layer.attn.rope]
            hidden = layer(hidden, layer_cos, layer_sin, kv_cache[i], backend, scales)
        return self.norm_fn(hidden, self.norm, self.config.rms_norm_eps)

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.embed_blocks is not None:
            rows = self.embed_blocks.lookup(input_ids).to(self.dtype)
        elif self.group is None:
            rows = F.embedding(input_ids, self.embed_tokens)
        else:
            start, stop = self.shard.vocab_range
            outside = (input_ids < start) | (input_ids >= stop)
            rows = F.embedding((input_ids - start).masked_fill(outside, 0), self.embed_tokens)
            rows = self.group.all_reduce(rows.masked_fill(outside.unsqueeze(-1), 0.0))
        return rows if self.embed_scale is None else rows * self.embed_scale.to(rows.device)

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Each row's argmax of ``compute_logits(hidden)`` (int64 ``[N]``), bitwise the token the full
        product picks, computed without it (``kernels/greedy_head.py``); None where that does not apply
        (then take ``compute_logits``)."""
        return None if self.greedy_head is None else self.greedy_head.argmax(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits ``[N, vocab]`` in float32 (with tensor parallelism: on rank 0; the others get their
        own shard's columns, which nobody reads)."""
        logits = self.lm_head_linear(hidden).float()
        if self.group is not None:
            if not hidden.shape[0]:  # a step that samples nothing (every rank knows): no gather
                return logits.new_empty(0, self.config.vocab_size)
            gathered = self.group.gather_columns(logits)
            logits = gathered[:, : self.config.vocab_size] if self.shard.rank == 0 else gathered
        cap = self.config.final_logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap


def _unfused(layer: DecoderLayer) -> list[str]:
    """Why a layer takes the per-layer path, in words."""
    attn = layer.attn
    if not isinstance(attn, Attention):
        return ["latent attention"] + (["mixture of experts"] if not hasattr(layer.mlp, "act_name") else [])
    reasons = {"q/k norms": attn.q_norm is not None, "sliding windows": attn.window is not None,
               "attention sinks": attn.sinks is not None, "softcaps": attn.softcap is not None,
               "output bias": attn.o_bias is not None, "sandwich norms": layer.sandwich,
               "mixture of experts": not hasattr(layer.mlp, "act_name"),
               "GELU": getattr(layer.mlp, "act_name", "silu") != "silu"}
    return [reason for reason, on in reasons.items() if on]

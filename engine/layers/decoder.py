"""``DecoderLayer``: attention and an MLP around two residual adds, pre-norm.

``forward``: ``h += attn(norm(h))``, then ``h += mlp(norm(h))`` (``input_layernorm``,
``post_attention_layernorm``). With ``sandwich`` norms (Gemma 3) each branch's output is normed again
before its residual add: ``h += post_attention_norm(attn(input_norm(h)))``, then
``h += post_feedforward_norm(mlp(pre_feedforward_norm(h)))``. The MLP is the dense ``GatedMLP`` or
the ``MoE`` (``ModelConfig.is_moe_layer``).

Fused native paths: on float32 CPU with the native kernels built, a ``fusable`` layer (plain Llama:
pre-norm with the standard RMSNorm, plain attention, a dense SiLU MLP) runs ``forward_fused``: each
residual add is done in place together with the norm after it, rope rotates q and k in place in the
QKV product's output, and SiLU*up is one call (same values as ``forward`` up to the norm's and SiLU's
rounding). A model of fusable layers whose products all hold packed copies hands each layer's
``native_weights`` to the one-call decoder (``kernels/native_decoder.py``). Anything else takes
``forward``.
"""

from __future__ import annotations

import torch

from engine.layers.attention import Attention
from engine.layers.context import LayerContext
from engine.layers.mla import MlaAttention
from engine.layers.mlp import GatedMLP
from engine.layers.moe import MoE
from engine.layers.prepared import Prepared, weight
from kernels.attention import AttentionBackend
from kernels.native_decoder import DecoderLayerWeights
from kernels.native_ops import NativeOps
from kernels.norm import rms_norm


class DecoderLayer(Prepared):
    def __init__(self, ctx: LayerContext, layer: int, sandwich: bool = False) -> None:
        super().__init__()
        c = ctx.config
        self.ctx = ctx
        self.eps = c.rms_norm_eps
        self.sandwich = sandwich
        h, dt, dev = c.hidden_size, ctx.dtype, ctx.device
        self.input_norm = weight(h, dtype=dt, device=dev)
        self.post_norm = weight(h, dtype=dt, device=dev)
        self.pre_ff_norm = weight(h, dtype=dt, device=dev) if sandwich else None
        self.post_ff_norm = weight(h, dtype=dt, device=dev) if sandwich else None
        self.attn: Attention | MlaAttention = (MlaAttention(ctx, layer) if c.mla is not None
                                               else Attention(ctx, layer))
        self.mlp: GatedMLP | MoE = (MoE(ctx) if c.is_moe_layer(layer)
                                    else GatedMLP(ctx, ctx.shard.intermediate_size))

    @property
    def fusable(self) -> bool:
        """Whether the fused native paths compute this layer (see the module docstring)."""
        return (not self.sandwich and self.ctx.norm is rms_norm and isinstance(self.attn, Attention)
                and self.attn.plain
                and isinstance(self.mlp, GatedMLP) and self.mlp.act_name == "silu")

    def native_weights(self) -> DecoderLayerWeights | None:
        """The layer's tensors for the one-call decoder; None where it is not fusable or a product holds
        no packed copy."""
        if not self.fusable or not isinstance(self.mlp, GatedMLP) or not isinstance(self.attn, Attention):
            return None
        attn, mlp = self.attn, self.mlp
        qkv, o = attn.qkv_linear.packed, attn.o_linear.packed
        gate_up, down = mlp.gate_up_linear.packed, mlp.down_linear.packed
        if qkv is None or o is None or gate_up is None or down is None:
            return None
        bias = None if attn.qkv_bias is None else attn.qkv_bias.data
        linears = (attn.qkv_linear, attn.o_linear, mlp.gate_up_linear, mlp.down_linear)
        return DecoderLayerWeights(self.input_norm.data, qkv, bias, o, self.post_norm.data, gate_up, down,
                                   tuple(lin.native_format for lin in linears))

    def block_targets(self, prefix: str) -> dict[str, tuple[Prepared, str, int, int | None]]:
        """Hugging Face name -> (module, matrix, first row, expert or None) of the matrices that can be built
        from GGUF blocks (dense attention's, the dense MLP's and each expert's; ``Prepared.set_blocks``)."""
        found: dict[str, tuple[Prepared, str, int, int | None]] = {}
        for module, sub in ((self.attn, "self_attn"), (self.mlp, "mlp")):
            if isinstance(module, (Attention, GatedMLP)):
                found |= {name: (module, attr, row, None)
                          for name, (attr, row) in module.block_targets(f"{prefix}.{sub}").items()}
            elif isinstance(module, MoE):
                found |= {name: (module, attr, row, expert)
                          for name, (attr, row, expert) in module.block_targets(f"{prefix}.{sub}").items()}
        return found

    def hf_targets(self, prefix: str) -> dict[str, torch.Tensor]:
        """Hugging Face name (under ``prefix``, e.g. ``model.layers.0``) -> the tensor it fills."""
        targets = {f"{prefix}.input_layernorm.weight": self.input_norm.data,
                   f"{prefix}.post_attention_layernorm.weight": self.post_norm.data}
        if self.pre_ff_norm is not None and self.post_ff_norm is not None:
            targets[f"{prefix}.pre_feedforward_layernorm.weight"] = self.pre_ff_norm.data
            targets[f"{prefix}.post_feedforward_layernorm.weight"] = self.post_ff_norm.data
        return targets | self.attn.hf_targets(f"{prefix}.self_attn") | self.mlp.hf_targets(f"{prefix}.mlp")

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_layer: torch.Tensor,
                backend: AttentionBackend, kv_scales: torch.Tensor | None = None) -> torch.Tensor:
        norm, eps = self.ctx.norm, self.eps
        attn = self.attn(norm(hidden, self.input_norm, eps), cos, sin, kv_layer, backend, kv_scales)
        if self.pre_ff_norm is None or self.post_ff_norm is None:
            hidden = hidden + attn
            return hidden + self.mlp(norm(hidden, self.post_norm, eps))
        hidden = hidden + norm(attn, self.post_norm, eps)
        return hidden + norm(self.mlp(norm(hidden, self.pre_ff_norm, eps)), self.post_ff_norm, eps)

    def forward_fused(self, hidden: torch.Tensor, delta: torch.Tensor | None, cos: torch.Tensor,
                      sin: torch.Tensor, kv_layer: torch.Tensor, backend: AttentionBackend, ops: NativeOps,
                      kv_scales: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward`` of a fusable layer with the residual adds deferred: the layer's input is
        ``hidden + delta`` (``delta`` None: ``hidden``), and it returns ``(residual, delta)`` whose sum
        is its output. ``hidden`` is updated in place."""
        attn, mlp = self.attn, self.mlp
        assert isinstance(mlp, GatedMLP) and isinstance(attn, Attention)
        tokens = hidden.shape[0]
        h, kv_h, hd = attn.num_heads, attn.num_kv_heads, attn.head_dim
        x = ops.add_rms_norm(hidden, delta, self.input_norm, self.eps)
        qkv = attn.qkv_linear(x).view(tokens, h + 2 * kv_h, hd)
        ops.rope_(qkv, cos, sin, h + kv_h)
        out = backend.forward(qkv[:, :h], qkv[:, h : h + kv_h], qkv[:, h + kv_h :], kv_layer, attn.scale,
                              kv_scales)
        x = ops.add_rms_norm(hidden, self.ctx.reduce(attn.o_linear(out.reshape(tokens, h * hd))),
                             self.post_norm, self.eps)
        return hidden, self.ctx.reduce(mlp.down_linear(ops.silu_mul(mlp.gate_up_linear(x))))

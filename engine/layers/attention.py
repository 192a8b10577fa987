"""``Attention``: self-attention over the paged KV cache, as every family's layers compute it.

Weights (Hugging Face names under ``<layer>.self_attn``): ``q_proj``/``k_proj``/``v_proj`` fused into
one ``qkv`` matrix (rows: this rank's query heads, then its KV heads for K, then for V) with an
optional fused bias; ``o_proj`` (and its bias, gpt-oss, added on rank 0 only); ``q_norm``/``k_norm``,
an RMSNorm over each head's ``head_dim`` before rope (Qwen3, Gemma 3); ``sinks``, one float32 logit
per query head (gpt-oss).

Per layer (``ModelConfig``): the softmax ``scale`` (``attention_scale`` or ``head_dim ** -0.5``), the
sliding ``window`` of a ``sliding_attention`` layer, the logit ``softcap``, and ``rope``: which of the
model's rotary embeddings rotates it (0 the model's; 1 the sliding layers' own base, Gemma 3).
A layer that has none of q/k norms, a window, sinks, a softcap or an output bias is ``plain``: the
fused native paths (``engine/layers/decoder.py``) may take it.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.layers.context import LayerContext
from engine.layers.prepared import Prepared, weight
from kernels.attention import AttentionBackend
from kernels.linear import LinearKernel, PreparedLinear
from kernels.rope import apply_rotary


class Attention(Prepared):
    def __init__(self, ctx: LayerContext, layer: int) -> None:
        super().__init__()
        c, shard = ctx.config, ctx.shard
        self.ctx = ctx
        self.num_heads = shard.num_heads
        self.num_kv_heads = shard.num_kv_heads
        self.head_dim = hd = c.head_dim
        self.eps = c.rms_norm_eps
        self.scale = c.attention_scale if c.attention_scale is not None else hd**-0.5
        self.window = c.layer_window(layer)
        self.softcap = c.attn_logit_softcap
        self.rope = 1 if self.window is not None and c.local_rope_theta is not None else 0
        rows = (self.num_heads + 2 * self.num_kv_heads) * hd
        dt, dev = ctx.dtype, ctx.device
        self.qkv = weight(rows, c.hidden_size, dtype=dt, device=dev)
        self.qkv_bias = weight(rows, dtype=dt, device=dev) if c.attention_bias else None
        self.o_proj = weight(c.hidden_size, self.num_heads * hd, dtype=dt, device=dev)
        self.o_bias = weight(c.hidden_size, dtype=dt, device=dev) if c.o_proj_bias else None
        self.q_norm = weight(hd, dtype=dt, device=dev) if c.qk_norm else None
        self.k_norm = weight(hd, dtype=dt, device=dev) if c.qk_norm else None
        self.sinks = weight(self.num_heads, dtype=torch.float32, device=dev) if c.attention_sinks else None
        self.prepare_linears("plain")

    def _build_linears(self, kernel: LinearKernel) -> None:
        self.qkv_linear = PreparedLinear(self.qkv, self.qkv_bias, kernel, self.blocks("qkv"))
        self.o_linear = PreparedLinear(self.o_proj, self.o_bias if self.ctx.rank0 else None, kernel,
                                       self.blocks("o_proj"))

    def _matrices(self) -> list[tuple[nn.Parameter, list[PreparedLinear]]]:
        return [(self.qkv, [self.qkv_linear]), (self.o_proj, [self.o_linear])]

    @property
    def plain(self) -> bool:
        """Llama's attention exactly: what the fused native paths compute."""
        return (self.q_norm is None and self.window is None and self.sinks is None and self.softcap is None
                and self.o_bias is None and self.rope == 0)

    def block_targets(self, prefix: str) -> dict[str, tuple[str, int]]:
        """Hugging Face name -> (matrix, first row) for the matrices that take GGUF blocks."""
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return {f"{prefix}.q_proj.weight": ("qkv", 0), f"{prefix}.k_proj.weight": ("qkv", q),
                f"{prefix}.v_proj.weight": ("qkv", q + kv), f"{prefix}.o_proj.weight": ("o_proj", 0)}

    def hf_targets(self, prefix: str) -> dict[str, torch.Tensor]:
        """Hugging Face name (under ``prefix``, e.g. ``model.layers.0.self_attn``) -> the tensor it fills."""
        self.restore_plain()
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        qkv = self.qkv.data
        targets = {f"{prefix}.q_proj.weight": qkv[:q], f"{prefix}.k_proj.weight": qkv[q : q + kv],
                   f"{prefix}.v_proj.weight": qkv[q + kv :], f"{prefix}.o_proj.weight": self.o_proj.data}
        if self.qkv_bias is not None:
            bias = self.qkv_bias.data
            targets |= {f"{prefix}.q_proj.bias": bias[:q], f"{prefix}.k_proj.bias": bias[q : q + kv],
                        f"{prefix}.v_proj.bias": bias[q + kv :]}
        optional = {"o_proj.bias": self.o_bias, "q_norm.weight": self.q_norm, "k_norm.weight": self.k_norm,
                    "sinks": self.sinks}
        targets |= {f"{prefix}.{name}": p.data for name, p in optional.items() if p is not None}
        return targets

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_layer: torch.Tensor,
                backend: AttentionBackend, kv_scales: torch.Tensor | None = None) -> torch.Tensor:
        """The attention output ``[T, hidden]`` (summed over the group) of the normed input ``x``."""
        tokens = x.shape[0]
        h, kv_h = self.num_heads, self.num_kv_heads
        qkv = self.qkv_linear(x).view(tokens, h + 2 * kv_h, self.head_dim)
        v = qkv[:, h + kv_h :]
        if self.q_norm is None or self.k_norm is None:
            qk = apply_rotary(qkv[:, : h + kv_h], cos, sin)
            q, k = qk[:, :h], qk[:, h:]
        else:
            q = apply_rotary(self.ctx.norm(qkv[:, :h], self.q_norm, self.eps), cos, sin)
            k = apply_rotary(self.ctx.norm(qkv[:, h : h + kv_h], self.k_norm, self.eps), cos, sin)
        if self.plain:
            attn = backend.forward(q, k, v, kv_layer, self.scale, kv_scales)
        else:
            attn = backend.forward(q, k, v, kv_layer, self.scale, kv_scales, window=self.window,
                                   sinks=self.sinks, softcap=self.softcap)
        return self.ctx.reduce(self.o_linear(attn.reshape(tokens, h * self.head_dim)))

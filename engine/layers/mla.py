"""``MlaAttention``: DeepSeek's multi-head latent attention over a paged latent cache.

Weights (Hugging Face names under ``<layer>.self_attn``): the query from ``q_proj``, or through a LoRA
(``q_a_proj``, its RMSNorm ``q_a_layernorm``, ``q_b_proj``); ``kv_a_proj_with_mqa``, the latent
(RMSNormed by ``kv_a_layernorm``) and the shared rotary key; ``kv_b_proj``, whose rows per head are
the key's no-rope part (``w_uk``) and the value (``w_uv``) as up-projections of the latent; ``o_proj``.
This rank's query heads (``kv_b_proj``'s and ``o_proj``'s rows and columns of them); the latent and its
products are whole on every rank, so each rank caches the same latent.

Per token the cache takes one row of ``MlaConfig.latent_dim`` values (``kernels/mla.py``), attention
runs in the expanded form for prompt chunks and the absorbed form for decode rows, and rope rotates the
rotary dims as DeepSeek lays them out (adjacent pairs, ``rope_interleave``). The softmax scale is the
config's (``qk_head_dim ** -0.5``, times YaRN's ``mscale`` squared where the family's config says).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.layers.context import LayerContext
from engine.layers.prepared import Prepared, weight
from kernels.linear import LinearKernel, PreparedLinear
from kernels.mla import MlaTorchBackend
from kernels.rope import apply_rotary, apply_rotary_interleaved


class MlaAttention(Prepared):
    window = None
    rope = 0
    plain = False

    def __init__(self, ctx: LayerContext, layer: int) -> None:
        super().__init__()
        c, mla = ctx.config, ctx.config.mla
        assert mla is not None
        self.ctx = ctx
        self.mla = mla
        self.num_heads = heads = ctx.shard.num_heads
        self.eps = c.rms_norm_eps
        self.scale = c.attention_scale if c.attention_scale is not None else mla.qk_head_dim**-0.5
        dt, dev, hidden = ctx.dtype, ctx.device, c.hidden_size
        q_rows = heads * mla.qk_head_dim
        if mla.q_lora_rank is None:
            self.q_proj: nn.Parameter | None = weight(q_rows, hidden, dtype=dt, device=dev)
            self.q_a_proj = self.q_a_norm = self.q_b_proj = None
        else:
            self.q_proj = None
            self.q_a_proj = weight(mla.q_lora_rank, hidden, dtype=dt, device=dev)
            self.q_a_norm = weight(mla.q_lora_rank, dtype=dt, device=dev)
            self.q_b_proj = weight(q_rows, mla.q_lora_rank, dtype=dt, device=dev)
        self.kv_a_proj = weight(mla.latent_dim, hidden, dtype=dt, device=dev)
        self.kv_a_norm = weight(mla.kv_lora_rank, dtype=dt, device=dev)
        self.kv_b_proj = weight(heads * (mla.qk_nope_head_dim + mla.v_head_dim), mla.kv_lora_rank, dtype=dt,
                                device=dev)
        self.o_proj = weight(hidden, heads * mla.v_head_dim, dtype=dt, device=dev)
        self.prepare_linears("plain")

    def _build_linears(self, kernel: LinearKernel) -> None:
        self.q_linears = [PreparedLinear(p, None, kernel) for p in (self.q_proj, self.q_a_proj, self.q_b_proj)
                          if p is not None]
        self.kv_a_linear = PreparedLinear(self.kv_a_proj, None, kernel)
        self.o_linear = PreparedLinear(self.o_proj, None, kernel)

    def _matrices(self) -> list[tuple[nn.Parameter, list[PreparedLinear]]]:
        params = [p for p in (self.q_proj, self.q_a_proj, self.q_b_proj) if p is not None]
        return [*((p, [lin]) for p, lin in zip(params, self.q_linears, strict=True)),
                (self.kv_a_proj, [self.kv_a_linear]), (self.o_proj, [self.o_linear])]

    def hf_targets(self, prefix: str) -> dict[str, torch.Tensor]:
        self.restore_plain()
        named = {"q_proj.weight": self.q_proj, "q_a_proj.weight": self.q_a_proj,
                 "q_a_layernorm.weight": self.q_a_norm, "q_b_proj.weight": self.q_b_proj,
                 "kv_a_proj_with_mqa.weight": self.kv_a_proj, "kv_a_layernorm.weight": self.kv_a_norm,
                 "kv_b_proj.weight": self.kv_b_proj, "o_proj.weight": self.o_proj}
        return {f"{prefix}.{name}": p.data for name, p in named.items() if p is not None}

    def _query(self, x: torch.Tensor) -> torch.Tensor:
        if len(self.q_linears) == 1:
            return self.q_linears[0](x)
        assert self.q_a_norm is not None
        q_a, q_b = self.q_linears
        return q_b(self.ctx.norm(q_a(x), self.q_a_norm, self.eps))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_layer: torch.Tensor,
                backend: MlaTorchBackend, kv_scales: torch.Tensor | None = None) -> torch.Tensor:
        """The attention output ``[T, hidden]`` (summed over the group) of the normed input ``x``."""
        m, tokens = self.mla, x.shape[0]
        q = self._query(x).view(tokens, self.num_heads, m.qk_head_dim)
        q_nope, q_rope = q[..., : m.qk_nope_head_dim], q[..., m.qk_nope_head_dim :]
        compressed = self.kv_a_linear(x)
        latent = self.ctx.norm(compressed[:, : m.kv_lora_rank], self.kv_a_norm, self.eps)
        k_rope = compressed[:, None, m.kv_lora_rank :]
        rotate = apply_rotary_interleaved if m.rope_interleave else apply_rotary
        q_rope, k_rope = rotate(q_rope, cos, sin), rotate(k_rope, cos, sin)
        w = self.kv_b_proj.view(self.num_heads, m.qk_nope_head_dim + m.v_head_dim, m.kv_lora_rank)
        out = backend.forward(q_nope, q_rope, torch.cat((latent, k_rope[:, 0]), dim=-1), kv_layer,
                              w[:, : m.qk_nope_head_dim], w[:, m.qk_nope_head_dim :], self.scale, kv_scales)
        return self.ctx.reduce(self.o_linear(out.reshape(tokens, self.num_heads * m.v_head_dim)))

"""Decode steps through torch.compile'd (inductor, C++) decoder layers, one graph per batch bucket.

Each layer runs as ``pre_attention`` (norm, QKV product, rope; compiled), the
attention backend (eager: it reads the paged metadata), then ``post_attention``
(output product, residual, norm, gate/up product, SiLU*mul, down product,
residual; compiled). Both are plain functions of tensors (weights and packed
weights are arguments, not module state), so one graph per bucket serves every
layer. Graphs are static-shaped: the decode batch is padded to the next bucket
(``engine/buckets.py``) around the compiled parts only (the attention backend
sees the real rows), so each bucket compiles once, on its first step. Steps that
are not pure decode, or larger than the largest bucket, run eagerly.

Compiled code is cached on disk (inductor's FX graph cache under
``$PDSERVE_CACHE/inductor`` unless ``TORCHINDUCTOR_CACHE_DIR`` is set), so a
restart reuses it. Outputs match the eager path to float rounding (inductor
fuses the norms and elementwise ops); greedy tokens are checked against eager in
the tests.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from engine.buckets import decode_buckets, padded_batch_size
from engine.layers.attention import Attention
from engine.layers.mlp import GatedMLP
from engine.loader import cache_root
from engine.models.causal_lm import CausalLM
from kernels.activation import silu_mul
from kernels.attention import AttentionBackend, AttentionMetadata
from kernels.linear import prepared_linear_op as prepared_linear
from kernels.norm import rms_norm
from kernels.rope import apply_rotary

Tensor = torch.Tensor


def pre_attention(hidden: Tensor, norm_w: Tensor, qkv_w: Tensor, qkv_packed: Tensor | None,
                  qkv_bias: Tensor | None, cos: Tensor, sin: Tensor, heads: int, kv_heads: int,
                  head_dim: int, eps: float) -> tuple[Tensor, Tensor]:
    """Rotated ``[T, heads + kv_heads, head_dim]`` queries and keys, and the values."""
    x = rms_norm(hidden, norm_w, eps)
    qkv = prepared_linear(x, qkv_w, qkv_packed, qkv_bias)
    qkv = qkv.view(hidden.shape[0], heads + 2 * kv_heads, head_dim)
    return apply_rotary(qkv[:, : heads + kv_heads], cos, sin), qkv[:, heads + kv_heads :]


def post_attention(hidden: Tensor, attn: Tensor, o_w: Tensor, o_packed: Tensor | None, norm_w: Tensor,
                   gate_up_w: Tensor, gate_up_packed: Tensor | None, down_w: Tensor,
                   down_packed: Tensor | None, eps: float) -> Tensor:
    """The layer's output: residual + output product, then residual + the gated MLP."""
    hidden = hidden + prepared_linear(attn, o_w, o_packed, None)
    x = rms_norm(hidden, norm_w, eps)
    up = silu_mul(prepared_linear(x, gate_up_w, gate_up_packed, None))
    return hidden + prepared_linear(up, down_w, down_packed, None)


def use_disk_cache() -> None:
    """Inductor's caches under ``$PDSERVE_CACHE/inductor`` (unless set already), FX graph cache on."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_root() / "inductor"))
    import torch._inductor.config as inductor_config

    inductor_config.fx_graph_cache = True


def _pad(x: Tensor, rows: int) -> Tensor:
    if x.shape[0] == rows:
        return x
    return F.pad(x, [0, 0] * (x.dim() - 1) + [0, rows - x.shape[0]])


class CompiledDecoder:
    """Runs ``CausalLM.forward`` for decode batches through the compiled layer halves."""

    def __init__(self, model: CausalLM, max_num_seqs: int) -> None:
        if not model.fusable:
            raise ValueError(f"the compiled decode path runs plain Llama layers only, not "
                             f"{model.config.architecture}'s ({model.execution_path})")
        use_disk_cache()
        self.model = model
        model.restore_plain_weights()  # the compiled halves take the [out, in] matrices
        self.buckets = decode_buckets(max_num_seqs)
        # one graph per bucket and function; dynamo's default limit (8) would fall back to eager
        limit = 2 * len(self.buckets) + 4
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, limit)
        compile_opts: dict[str, Any] = {"backend": "inductor", "dynamic": False, "fullgraph": True}
        self._pre: Callable[..., tuple[Tensor, Tensor]] = torch.compile(pre_attention, **compile_opts)
        self._post: Callable[..., Tensor] = torch.compile(post_attention, **compile_opts)

    def handles(self, meta: AttentionMetadata) -> bool:
        """A pure decode step (every query one token) no larger than the largest bucket."""
        return meta.num_tokens <= self.buckets[-1] and all(q == 1 for q in meta.query_lens_list)

    def forward(self, input_ids: Tensor, positions: Tensor, kv_cache: Tensor, backend: AttentionBackend,
                kv_scales: Tensor | None = None) -> Tensor:
        """Final-normed hidden states ``[T, hidden]``, as ``CausalLM.forward``; ``backend`` is prepared."""
        m, cfg = self.model, self.model.config
        n = input_ids.shape[0]
        rows = padded_batch_size(n, self.buckets)
        assert rows is not None, "forward() is only called when applies()"
        hidden = F.embedding(_pad(input_ids, rows), m.embed_tokens)
        cos, sin = m.rotary.cos_sin(_pad(positions, rows), m.dtype)
        for i, layer in enumerate(m.decoder_layers()):
            a, mlp = layer.attn, layer.mlp
            assert isinstance(mlp, GatedMLP) and isinstance(a, Attention)
            h = a.num_heads
            qk, v = self._pre(hidden, layer.input_norm, a.qkv, a.qkv_linear.packed_row,
                              a.qkv_bias, cos, sin, h, a.num_kv_heads, a.head_dim, layer.eps)
            scales = kv_scales[i] if kv_scales is not None else None
            attn = backend.forward(qk[:n, :h], qk[:n, h:], v[:n], kv_cache[i], a.scale, scales)
            attn_rows = _pad(attn.reshape(n, h * a.head_dim), rows)
            hidden = self._post(hidden, attn_rows, a.o_proj, a.o_linear.packed_row, layer.post_norm,
                                mlp.gate_up, mlp.gate_up_linear.packed_row, mlp.down_proj,
                                mlp.down_linear.packed_row, layer.eps)
        return rms_norm(hidden[:n], m.norm, cfg.rms_norm_eps)

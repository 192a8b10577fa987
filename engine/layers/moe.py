"""``MoE``: a router and its experts, the mixture-of-experts MLP.

Weights (Hugging Face names under ``<layer>.mlp``, each family's module maps its checkpoint's names
onto these): the router ``gate.weight`` ``[E, hidden]`` (and ``gate.bias``, gpt-oss), replicated on
every rank; per expert ``e``, ``experts.<e>.gate_proj`` / ``up_proj`` fused into ``w13[e]`` (rows:
gate, then up; this rank's columns of the experts' intermediate size) and ``experts.<e>.down_proj``
as ``w2[e]`` (row-parallel), with optional biases (gpt-oss; the down bias added on rank 0 only).

Routing (``MoeConfig.router``, which says each kind exactly): softmax then top k (Mixtral, Qwen3-MoE;
DeepSeek-V2, its group-limited variant too), top k then softmax (gpt-oss), or DeepSeek-V3's sigmoid
scores chosen by group with the router's correction bias (``gate.e_score_correction_bias``). The
weights stay float32. DeepSeek's shared experts (``shared_experts.*``, a dense SiLU MLP) add their
output to the routed experts'. Each expert present in the step computes its products once for all of its
tokens, in ascending expert order, and adds ``weight * output`` into each token's row (the order
transformers adds them in). On CPU the products are the model's prepared products (packed for the
native kernel); on CUDA the fused kernel (``kernels/moe.py``).

``on_route`` (None by default, which costs one attribute test per forward): a callable given, once per
forward, the list of every expert's token count in that forward (the counts the forward groups by), so
a benchmark can count the experts a step reads.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from engine.config import MoeConfig
from engine.layers.context import LayerContext
from engine.layers.mlp import GatedMLP
from engine.layers.prepared import Prepared, weight
from kernels.fused_moe import fused_moe
from kernels.linear import LinearKernel, PreparedLinear
from kernels.moe import MoeActivation


def _group_mask(group_scores: torch.Tensor, moe: MoeConfig) -> torch.Tensor:
    """Boolean ``[T, E]``: the experts of each token's ``topk_group`` best groups."""
    picked = torch.topk(group_scores, moe.topk_group, dim=-1, sorted=False).indices
    mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, picked, True)
    return mask.repeat_interleave(moe.num_experts // moe.n_group, dim=1)


def route(logits: torch.Tensor, moe: MoeConfig,
          correction: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's ``top_k`` expert weights (float32) and ids (int64) from its router logits."""
    tokens = logits.shape[0]
    if moe.router == "topk_softmax":
        top, ids = torch.topk(logits, moe.top_k, dim=-1)
        return torch.softmax(top.float(), dim=-1), ids
    if moe.router == "sigmoid_group_topk":
        scores = logits.float().sigmoid()
        choice = scores if correction is None else scores + correction.float()
        groups = choice.view(tokens, moe.n_group, -1).topk(min(2, moe.num_experts // moe.n_group), dim=-1)
        choice = choice.masked_fill(~_group_mask(groups.values.sum(dim=-1), moe), float("-inf"))
        ids = torch.topk(choice, moe.top_k, dim=-1, sorted=False).indices
        top = scores.gather(1, ids)
        if moe.renormalize:
            top = top / (top.sum(dim=-1, keepdim=True) + 1e-20)
        return top * moe.routed_scaling_factor, ids
    probs = torch.softmax(logits.float(), dim=-1)
    if moe.router == "softmax_group_topk":
        best = probs.view(tokens, moe.n_group, -1).max(dim=-1).values
        probs = probs.masked_fill(~_group_mask(best, moe), 0.0)
    top, ids = torch.topk(probs, moe.top_k, dim=-1)
    if moe.renormalize:
        top = top / top.sum(dim=-1, keepdim=True)
    return top * moe.routed_scaling_factor, ids


class MoE(Prepared):
    def __init__(self, ctx: LayerContext) -> None:
        super().__init__()
        c, moe = ctx.config, ctx.config.moe
        assert moe is not None
        self.ctx = ctx
        self.moe = moe
        self.activation = MoeActivation(moe.activation, moe.swiglu_alpha, moe.swiglu_limit)
        experts, hidden = moe.num_experts, c.hidden_size
        inter = moe.intermediate_size // ctx.shard.size
        dt, dev = ctx.dtype, ctx.device
        self.router = weight(experts, hidden, dtype=dt, device=dev)
        self.router_bias = weight(experts, dtype=dt, device=dev) if moe.router_bias else None
        self.w13 = weight(experts, 2 * inter, hidden, dtype=dt, device=dev)
        self.w2 = weight(experts, hidden, inter, dtype=dt, device=dev)
        self.b13 = weight(experts, 2 * inter, dtype=dt, device=dev) if moe.expert_bias else None
        self.b2 = weight(experts, hidden, dtype=dt, device=dev) if moe.expert_bias else None
        self.correction = (weight(experts, dtype=torch.float32, device=dev) if moe.correction_bias else None)
        self.shared = (GatedMLP(ctx, moe.shared_intermediate_size // ctx.shard.size)
                       if moe.shared_intermediate_size else None)
        self.on_route: Callable[[list[int]], None] | None = None
        self.prepare_linears("plain")

    def _build_linears(self, kernel: LinearKernel) -> None:
        self.router_linear = PreparedLinear(self.router, self.router_bias, kernel)
        experts = range(self.moe.num_experts)
        b13 = self.b13
        b2 = self.b2 if self.ctx.rank0 else None  # row-parallel: one rank adds it
        self.w13_linears = [PreparedLinear(self.w13[e], None if b13 is None else b13[e], kernel,
                                           self.blocks("w13", e)) for e in experts]
        self.w2_linears = [PreparedLinear(self.w2[e], None if b2 is None else b2[e], kernel,
                                          self.blocks("w2", e)) for e in experts]
        # experts on kept blocks take their Triton products one expert at a time, on CUDA too
        self.triton_experts = any(lin.triton for lin in (*self.w13_linears, *self.w2_linears))

    def _matrices(self) -> list[tuple[nn.Parameter, list[PreparedLinear]]]:
        return [(self.router, [self.router_linear]), (self.w13, self.w13_linears), (self.w2, self.w2_linears)]

    def _float32_matrices(self) -> list[nn.Parameter]:
        return [self.router]

    def block_targets(self, prefix: str) -> dict[str, tuple[str, int, int]]:
        """Hugging Face name -> (stack, first row, expert) for the experts' matrices, which take GGUF
        blocks and checkpoint codes one expert at a time (``Prepared.set_blocks``)."""
        inter = self.w13.shape[1] // 2
        found: dict[str, tuple[str, int, int]] = {}
        for e in range(self.moe.num_experts):
            p = f"{prefix}.experts.{e}"
            found |= {f"{p}.gate_proj.weight": ("w13", 0, e), f"{p}.up_proj.weight": ("w13", inter, e),
                      f"{p}.down_proj.weight": ("w2", 0, e)}
        return found

    def hf_targets(self, prefix: str) -> dict[str, torch.Tensor]:
        self.restore_plain()
        inter = self.w13.shape[1] // 2
        targets = {f"{prefix}.gate.weight": self.router.data}
        if self.router_bias is not None:
            targets[f"{prefix}.gate.bias"] = self.router_bias.data
        if self.correction is not None:
            targets[f"{prefix}.gate.e_score_correction_bias"] = self.correction.data
        if self.shared is not None:
            targets |= self.shared.hf_targets(f"{prefix}.shared_experts")
        for e in range(self.moe.num_experts):
            p = f"{prefix}.experts.{e}"
            targets |= {f"{p}.gate_proj.weight": self.w13.data[e, :inter],
                        f"{p}.up_proj.weight": self.w13.data[e, inter:],
                        f"{p}.down_proj.weight": self.w2.data[e]}
            if self.b13 is not None and self.b2 is not None:
                targets |= {f"{p}.gate_proj.bias": self.b13.data[e, :inter],
                            f"{p}.up_proj.bias": self.b13.data[e, inter:],
                            f"{p}.down_proj.bias": self.b2.data[e]}
        return targets

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.router_linear(x), self.moe, self.correction)
        if x.is_cuda and not self.triton_experts:  # the fused kernel over the stacked float experts
            b2 = self.b2 if self.ctx.rank0 else None
            out = fused_moe(x, self.w13, self.w2, weights, ids, self.activation, self.b13, b2)
            out = self.ctx.reduce(out)
            return out if self.shared is None else out + self.shared(x)
        out = torch.zeros_like(x)
        flat = ids.flatten()
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.moe.num_experts).tolist()
        if self.on_route is not None:
            self.on_route(counts)
        flat_weights = weights.flatten()
        start = 0
        for expert, count in enumerate(counts):
            if not count:
                continue
            picks = order[start : start + count]
            start += count
            tokens = picks // self.moe.top_k
            gate_up = self.w13_linears[expert](x[tokens])
            h = self.activation(*gate_up.chunk(2, dim=-1))
            y = self.w2_linears[expert](h) * flat_weights[picks, None]
            out.index_add_(0, tokens, y.to(out.dtype))
        out = self.ctx.reduce(out)
        return out if self.shared is None else out + self.shared(x)

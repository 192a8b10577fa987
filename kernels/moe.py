"""Mixture-of-experts expert computation: the contract, the torch reference and the dispatch.

``fused_moe(x, w13, w2, topk_weights, topk_ids, activation, b13=None, b2=None)``:

* ``x`` ``[T, H]``; ``w13`` ``[E, 2*I, H]`` (rows ``0..I-1`` the gate projection, ``I..2I-1``
  the up projection, each an ``[out, in]`` matrix like ``nn.Linear``'s weight); ``w2``
  ``[E, H, I]``; ``b13`` ``[E, 2*I]`` and ``b2`` ``[E, H]`` optional biases, all in ``x``'s dtype.
* ``topk_weights`` ``[T, k]`` float32 and ``topk_ids`` ``[T, k]`` int64: token ``t``'s ``k``
  experts and their routing weights. An id of ``-1`` means "no expert" and contributes
  nothing (a tensor- or expert-parallel rank that does not hold the expert).
* For each token ``t`` and choice ``j`` with expert ``e = topk_ids[t, j]``:
  ``h = w13[e] @ x[t] + b13[e]``, ``a = act(h[:I], h[I:])``, ``y = w2[e] @ a + b2[e]``,
  and ``out[t] += topk_weights[t, j] * y``. The output is ``[T, H]`` in ``x``'s dtype.

Activations (``MoeActivation``): ``silu``: ``silu(gate) * up``; ``swiglu_oai`` (gpt-oss):
``gate.clamp(max=limit)``, ``up.clamp(-limit, limit)``, ``(up + 1) * gate * sigmoid(alpha * gate)``;
``gelu_tanh``: ``gelu(gate, approximate="tanh") * up``.

The reference groups the token-expert pairs by expert (a stable argsort of the ids) and runs
each expert present once, for all its tokens, as transformers' MoE layers do: products in
the input dtype (torch accumulates them in float32), the weighted sum over ``k`` in float32
(float64 for float64 inputs), cast to ``x``'s dtype once. It is the CPU path. On CUDA with
Triton installed ``kernels/fused_moe.py:fused_moe`` runs ``kernels/triton_moe.py`` instead, which
computes the same thing in a grouped GEMM.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

ACTIVATIONS = ("silu", "swiglu_oai", "gelu_tanh")


@dataclass(frozen=True)
class MoeActivation:
    """The gated activation between the two expert products; ``alpha``/``limit`` are gpt-oss's."""

    kind: str
    alpha: float = 1.702
    limit: float = 7.0

    def __post_init__(self) -> None:
        if self.kind not in ACTIVATIONS:
            raise ValueError(f"MoE activation must be one of {', '.join(ACTIVATIONS)}, got {self.kind!r}")

    @property
    def code(self) -> int:
        """The kernels' ``ACTIVATION`` constexpr: the index in ``ACTIVATIONS``."""
        return ACTIVATIONS.index(self.kind)

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if self.kind == "silu":
            return F.silu(gate) * up
        if self.kind == "gelu_tanh":
            return F.gelu(gate, approximate="tanh") * up
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


def check_moe_args(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                   topk_ids: torch.Tensor, b13: torch.Tensor | None, b2: torch.Tensor | None) -> None:
    """Raise ``ValueError`` naming the argument whose shape, dtype or device breaks the contract."""
    if x.dim() != 2:
        raise ValueError(f"x must be [tokens, hidden], got shape {tuple(x.shape)}")
    tokens, hidden = x.shape
    if w13.dim() != 3 or w13.shape[2] != hidden or w13.shape[1] % 2:
        raise ValueError(f"w13 must be [experts, 2 * intermediate, {hidden}], got {tuple(w13.shape)}")
    experts, inter = w13.shape[0], w13.shape[1] // 2
    if tuple(w2.shape) != (experts, hidden, inter):
        raise ValueError(f"w2 must be [{experts}, {hidden}, {inter}], got {tuple(w2.shape)}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != tokens or topk_ids.dtype != torch.int64:
        raise ValueError(f"topk_ids must be int64 [{tokens}, k], "
                         f"got {topk_ids.dtype} {tuple(topk_ids.shape)}")
    if topk_weights.shape != topk_ids.shape or topk_weights.dtype != torch.float32:
        raise ValueError(f"topk_weights must be float32 {tuple(topk_ids.shape)}, "
                         f"got {topk_weights.dtype} {tuple(topk_weights.shape)}")
    for name, bias, shape in (("b13", b13, (experts, 2 * inter)), ("b2", b2, (experts, hidden))):
        if bias is not None and tuple(bias.shape) != shape:
            raise ValueError(f"{name} must be {list(shape)}, got {tuple(bias.shape)}")
    for name, t in (("w13", w13), ("w2", w2), ("b13", b13), ("b2", b2)):
        if t is not None and t.dtype != x.dtype:
            raise ValueError(f"{name} must have x's dtype {x.dtype}, got {t.dtype}")
    for name, t in (("w13", w13), ("w2", w2), ("topk_weights", topk_weights), ("topk_ids", topk_ids),
                    ("b13", b13), ("b2", b2)):
        if t is not None and t.device != x.device:
            raise ValueError(f"{name} is on {t.device}, x on {x.device}")


def fused_moe_reference(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                        topk_ids: torch.Tensor, activation: MoeActivation, b13: torch.Tensor | None = None,
                        b2: torch.Tensor | None = None) -> torch.Tensor:
    """The module docstring's contract in torch, one pair of products per expert present."""
    check_moe_args(x, w13, w2, topk_weights, topk_ids, b13, b2)
    k = topk_ids.shape[1]
    inter = w13.shape[1] // 2
    flat_ids = topk_ids.reshape(-1)
    pairs = torch.nonzero(flat_ids >= 0).squeeze(1)  # flat (token, choice) indices with an expert
    ids = flat_ids[pairs]
    order = torch.argsort(ids, stable=True)
    pairs, ids = pairs[order], ids[order]
    counts = torch.bincount(ids, minlength=w13.shape[0]).tolist()
    if len(counts) > w13.shape[0]:
        raise ValueError(f"topk_ids holds expert {len(counts) - 1}; there are {w13.shape[0]} experts")
    weights = topk_weights.reshape(-1)
    out = torch.zeros(x.shape, dtype=torch.promote_types(x.dtype, torch.float32), device=x.device)
    start = 0
    for expert, count in enumerate(counts):
        if not count:
            continue
        rows = pairs[start:start + count]
        start += count
        tokens = torch.div(rows, k, rounding_mode="floor")
        h = F.linear(x[tokens], w13[expert], None if b13 is None else b13[expert])
        y = F.linear(activation(h[:, :inter], h[:, inter:]), w2[expert], None if b2 is None else b2[expert])
        out.index_add_(0, tokens, y.to(out.dtype) * weights[rows, None])
    return out.to(x.dtype)

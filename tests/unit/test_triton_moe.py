"""The Triton fused-MoE kernels (interpreted on CPU) against the torch reference of ``kernels/moe.py``.

Tolerances, from how each side rounds (``u`` = ``torch.finfo(dtype).eps / 2``, the unit roundoff;
``scale`` = the largest ``|out|``):

* float32: both sides run float32 products; only the order of the additions differs (dots of
  length H = 80 and I = 40, then k = 2 terms), a few ``u`` of ``scale`` (~1e-7): ``1e-5``.
* bfloat16 / float16: the reference rounds ``h``, ``act(h)`` and ``y`` to the dtype, the kernel
  rounds ``a`` and ``y``; both round the output once. Each rounding is at most ``u`` relative, of
  values about the output's size (``y`` is ``out`` over a routing weight, so up to ~2x it at top-2),
  and a rounding of ``a`` reaches the output through a dot of length I whose per-term errors have
  random signs, so it adds about ``u`` of ``scale``, not ``I * u``. Each side is then within a
  few ``u * scale`` of the exact result (measured here: at most 3.0, on either side):
  ``atol = 6 u * scale`` (bf16: 2.3% of the largest output; fp16: 0.3%), ``rtol = 2 u``, for
  the kernel against the reference and each of them against a float64 evaluation. A wrong
  expert, bias, weight or activation moves outputs by ~``scale``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import pytest
import torch

from kernels.fused_moe import fused_moe
from kernels.moe import ACTIVATIONS, MoeActivation, fused_moe_reference
from kernels.triton_moe import moe_align, triton_fused_moe

HIDDEN, INTER, EXPERTS, TOP_K = 80, 40, 8, 2  # H, I not multiples of any block: every edge is masked
EMPTY_EXPERT = 5  # routed no token in the random cases
MoeFn = Callable[..., torch.Tensor]


class Case(NamedTuple):
    x: torch.Tensor
    w13: torch.Tensor
    w2: torch.Tensor
    topk_weights: torch.Tensor
    topk_ids: torch.Tensor
    b13: torch.Tensor | None
    b2: torch.Tensor | None

    def run(self, fn: MoeFn, activation: MoeActivation) -> torch.Tensor:
        return fn(self.x, self.w13, self.w2, self.topk_weights, self.topk_ids, activation, self.b13, self.b2)


def _case(tokens: int, dtype: torch.dtype, bias: bool, seed: int = 0) -> Case:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, generator=gen)
    w13 = torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=gen) / HIDDEN**0.5
    w2 = torch.randn(EXPERTS, HIDDEN, INTER, generator=gen) / INTER**0.5
    logits = torch.randn(tokens, EXPERTS, generator=gen)
    logits[:, EMPTY_EXPERT] = float("-inf")
    weights, ids = torch.softmax(logits, dim=-1).topk(TOP_K, dim=-1)
    if tokens > 3:
        ids[1, 0] = -1  # one choice held by another rank
        ids[3, :] = -1  # a token with no expert on this rank: its output is zero
    b13 = torch.randn(EXPERTS, 2 * INTER, generator=gen).to(dtype) * 0.5 if bias else None
    b2 = torch.randn(EXPERTS, HIDDEN, generator=gen).to(dtype) * 0.5 if bias else None
    return Case(x.to(dtype), w13.to(dtype), w2.to(dtype), weights, ids, b13, b2)


def _float64(case: Case, activation: MoeActivation) -> torch.Tensor:
    """The contract evaluated token by token, choice by choice, in float64."""
    x, w13, w2, weights = case.x.double(), case.w13.double(), case.w2.double(), case.topk_weights.double()
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(TOP_K):
            e = int(case.topk_ids[t, j])
            if e < 0:
                continue
            h = w13[e] @ x[t] + (0 if case.b13 is None else case.b13[e].double())
            y = w2[e] @ activation(h[:INTER], h[INTER:]) + (0 if case.b2 is None else case.b2[e].double())
            out[t] += weights[t, j] * y
    return out


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, scale: float) -> None:
    """The module docstring's tolerance for ``dtype``, ``scale`` the largest exact output."""
    u = torch.finfo(dtype).eps / 2
    atol, rtol = (1e-5, 1e-5) if dtype == torch.float32 else (6 * u * scale, 2 * u)
    torch.testing.assert_close(actual.double(), expected.double(), atol=atol, rtol=rtol)


@pytest.mark.parametrize(("dtype", "kind", "bias"), [
    (torch.float32, "silu", False),
    (torch.float32, "swiglu_oai", True),
    (torch.float32, "gelu_tanh", False),
    (torch.bfloat16, "swiglu_oai", True),
    (torch.bfloat16, "silu", False),
    (torch.float16, "gelu_tanh", True),
])
def test_matches_reference(dtype: torch.dtype, kind: str, bias: bool) -> None:
    """40 tokens over 8 experts (large tiles), one expert unused, -1 ids, a token with none."""
    activation = MoeActivation(kind, alpha=1.702, limit=1.5)  # a limit the random h crosses
    case = _case(40, dtype, bias)
    out = case.run(triton_fused_moe, activation)
    ref = case.run(fused_moe_reference, activation)
    exact = _float64(case, activation)
    assert out.dtype == dtype and out.shape == (40, HIDDEN)
    assert torch.equal(out[3], torch.zeros(HIDDEN, dtype=dtype))
    scale = float(exact.abs().max())
    _assert_close(out, ref, dtype, scale)
    _assert_close(out, exact, dtype, scale)
    _assert_close(ref, exact, dtype, scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_single_token_small_tiles(dtype: torch.dtype) -> None:
    activation = MoeActivation("silu")
    case = _case(1, dtype, bias=True, seed=1)
    exact = _float64(case, activation)
    _assert_close(case.run(triton_fused_moe, activation), exact, dtype, float(exact.abs().max()))


def test_align_groups_pairs_by_expert_and_pads_blocks() -> None:
    ids = torch.tensor([[2, 0], [2, -1], [0, 2]])
    pairs, block_expert, padded = moe_align(ids, num_experts=4, block_m=4)
    # worst case 6 + min(4, 6) * 3 = 18 slots, rounded up to 20; sentinel 6 = T * k
    assert pairs.tolist() == [1, 4, 6, 6, 0, 2, 5, 6] + [6] * 12
    assert block_expert.tolist() == [0, 2, -1, -1, -1]  # experts 1 and 3 get no block
    assert padded.tolist() == [8]


def test_align_with_many_tokens_keeps_every_pair_once() -> None:
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(-1, 6, (300, 4), generator=gen)
    ids[ids == 3] = 4  # expert 3 gets no token
    pairs, block_expert, padded = moe_align(ids, num_experts=6, block_m=16)
    flat = ids.reshape(-1)
    live = pairs[: int(padded)]
    real = live[live < flat.numel()].long()
    assert sorted(real.tolist()) == torch.nonzero(flat >= 0).squeeze(1).tolist()
    blocks = block_expert[: int(padded) // 16].long()
    assert sorted(set(blocks.tolist())) == [0, 1, 2, 4, 5]
    assert torch.equal(flat[real], blocks.repeat_interleave(16)[live < flat.numel()])
    assert (block_expert[int(padded) // 16:] == -1).all()


def test_reference_matches_float64_loop_for_every_activation() -> None:
    case = _case(12, torch.float64, bias=True, seed=3)
    for kind in ACTIVATIONS:
        activation = MoeActivation(kind)
        ref = case.run(fused_moe_reference, activation)
        torch.testing.assert_close(ref, _float64(case, activation), atol=1e-12, rtol=1e-12)


def test_fused_moe_on_cpu_is_the_reference() -> None:
    activation = MoeActivation("swiglu_oai")
    case = _case(6, torch.float32, bias=True, seed=4)
    assert torch.equal(case.run(fused_moe, activation), case.run(fused_moe_reference, activation))


def test_bad_arguments_are_named() -> None:
    case = _case(4, torch.float32, bias=False)
    activation = MoeActivation("silu")
    with pytest.raises(ValueError, match="relu2"):
        MoeActivation("relu2")
    with pytest.raises(ValueError, match="w2 must be"):
        case._replace(w2=case.w13).run(fused_moe_reference, activation)
    with pytest.raises(ValueError, match="topk_ids must be int64"):
        case._replace(topk_ids=case.topk_ids.int()).run(fused_moe_reference, activation)
    with pytest.raises(ValueError, match="expert 8; there are 8"):
        case._replace(topk_ids=torch.full_like(case.topk_ids, 8)).run(fused_moe_reference, activation)
    with pytest.raises(ValueError, match="b2 must be"):
        case._replace(b2=torch.zeros(EXPERTS, 3)).run(fused_moe_reference, activation)
    with pytest.raises(ValueError, match="w13 must have x's dtype"):
        case._replace(w13=case.w13.double()).run(triton_fused_moe, activation)

"""The Triton fused MoE on CUDA against the torch reference, at model-like sizes, and under a CUDA graph
(skipped without CUDA; not yet run on a GPU, README.md).

Tolerance: ``tests/unit/test_triton_moe.py``'s bf16 rule, ``6 u * max|out|`` with ``u = 2**-8``; here
the 16-bit dots run on tensor cores (float32 accumulation), as on the GPU they always do.
"""

from __future__ import annotations

import pytest
import torch

from kernels.fused_moe import fused_moe
from kernels.moe import MoeActivation, fused_moe_reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
HIDDEN, INTER, EXPERTS, TOP_K = 1024, 384, 64, 8


def _inputs(tokens: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device="cuda")

    x = randn(tokens, HIDDEN).bfloat16()
    w13 = (randn(EXPERTS, 2 * INTER, HIDDEN) / HIDDEN**0.5).bfloat16()
    w2 = (randn(EXPERTS, HIDDEN, INTER) / INTER**0.5).bfloat16()
    weights, ids = torch.softmax(randn(tokens, EXPERTS), dim=-1).topk(TOP_K, dim=-1)
    ids[::5, 3] = -1  # choices held by another rank
    return x, w13, w2, weights, ids, (randn(EXPERTS, 2 * INTER) * 0.1).bfloat16(), \
        (randn(EXPERTS, HIDDEN) * 0.1).bfloat16()


@pytest.mark.parametrize("tokens", [1, 7, 300, 4096])
@pytest.mark.parametrize("kind", ["silu", "swiglu_oai"])
def test_fused_moe_matches_reference(tokens: int, kind: str) -> None:
    x, w13, w2, weights, ids, b13, b2 = _inputs(tokens)
    activation = MoeActivation(kind)
    bias = (b13, b2) if kind == "swiglu_oai" else (None, None)
    out = fused_moe(x, w13, w2, weights, ids, activation, *bias)
    ref = fused_moe_reference(x, w13, w2, weights, ids, activation, *bias)
    atol = 6 * 2**-8 * float(ref.float().abs().max())
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=2**-7)


def test_fused_moe_replays_in_a_cuda_graph() -> None:
    """Routing changes between replays: the alignment runs on the device, inside the graph."""
    x, w13, w2, weights, ids, _, _ = _inputs(16)
    activation = MoeActivation("silu")
    static = [t.clone() for t in (x, weights, ids)]
    for _ in range(2):  # warm-up: Triton compiles outside the capture
        fused_moe(static[0], w13, w2, static[1], static[2], activation)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe(static[0], w13, w2, static[1], static[2], activation)
    for seed in (1, 2):
        new_x, _, _, new_w, new_ids, _, _ = _inputs(16, seed)
        for buf, value in zip(static, (new_x, new_w, new_ids), strict=True):
            buf.copy_(value)
        graph.replay()
        want = fused_moe(new_x, w13, w2, new_w, new_ids, activation)
        assert torch.equal(out, want)

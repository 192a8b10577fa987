"""PreparedLinear: the prepacked kernels against F.linear, and the bucket helpers."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.activation import silu_mul
from kernels.linear import LARGE_ROWS, LinearKernel, PreparedLinear, prepacked_available


@pytest.mark.parametrize("rows", [0, 1, 3, 64])
@pytest.mark.parametrize("with_bias", [False, True])
def test_prepacked_matches_f_linear(rows: int, with_bias: bool) -> None:
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 40, generator=gen)
    bias = torch.randn(96, generator=gen) if with_bias else None
    x = torch.randn(rows, 40, generator=gen)
    layer = PreparedLinear(weight, bias)
    assert layer.kernel == ("prepacked" if prepacked_available(weight) else "plain")
    out = layer(x)
    assert out.shape == (rows, 96)
    torch.testing.assert_close(out, F.linear(x, weight, bias), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kernel", ["prepacked", "native"])
def test_prefill_chunks_take_torchs_default_product(kernel: LinearKernel) -> None:
    """Above ``LARGE_ROWS`` rows every kernel is ``F.linear`` itself (bitwise: the same MKL product),
    where oneDNN's, taken up to that many, sums in another order (docs/benchmarks.md, "... prompt chunks
    on MKL's product ...")."""
    gen = torch.Generator().manual_seed(7)
    weight, bias = torch.randn(960, 576, generator=gen), torch.randn(960, generator=gen)
    layer = PreparedLinear(weight, bias, kernel)
    for rows in (LARGE_ROWS + 1, 300):
        x = torch.randn(rows, 576, generator=gen)
        assert torch.equal(layer(x), F.linear(x, weight, bias))
    if prepacked_available(weight):  # up to LARGE_ROWS the prepacked kernel is oneDNN's, not F.linear
        x = torch.randn(LARGE_ROWS, 576, generator=gen)
        got = PreparedLinear(weight, bias, "prepacked")(x)
        assert not torch.equal(got, F.linear(x, weight, bias))
        torch.testing.assert_close(got, F.linear(x, weight, bias), atol=1e-4, rtol=1e-5)


def test_prepacked_packs_fp32_cpu_weights_only() -> None:
    if not prepacked_available(torch.zeros(2, 2)):
        pytest.skip("this torch build has no MKL / oneDNN")
    assert PreparedLinear(torch.randn(8, 4)).extra_bytes > 0
    half = PreparedLinear(torch.randn(8, 4, dtype=torch.bfloat16))
    assert half.kernel == "plain" and half.extra_bytes == 0
    plain = PreparedLinear(torch.randn(8, 4), kernel="plain")
    assert plain.extra_bytes == 0
    with pytest.raises(ValueError, match="unknown linear kernel"):
        PreparedLinear(torch.randn(8, 4), kernel="fast")  # type: ignore[arg-type]


def test_silu_mul_is_bitwise_the_unfused_expression() -> None:
    gate_up = torch.randn(5, 32)
    gate, up = gate_up.chunk(2, dim=-1)
    assert torch.equal(silu_mul(gate_up), F.silu(gate) * up)

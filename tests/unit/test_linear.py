"""PreparedLinear: the prepacked kernels against F.linear, and the bucket helpers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kernels import linear
from kernels.activation import silu_mul
from kernels.linear import (
    LARGE_ROWS,
    LargeProduct,
    LinearKernel,
    PreparedLinear,
    onednn_linear,
    prepacked_available,
)


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


@pytest.mark.parametrize("product", ["mkl", "onednn"])
@pytest.mark.parametrize("kernel", ["prepacked"])
def test_prefill_chunks_take_the_machines_large_product(kernel: LinearKernel, product: LargeProduct,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Above ``LARGE_ROWS`` rows the prepacked kernel is ``LARGE_PRODUCT``'s product, bitwise: ``F.linear``
    itself (MKL's) or oneDNN's inner product, which sums in another order (docs/benchmarks.md, "Prompt
    chunks on oneDNN's product off Intel CPUs"). The native kernel takes every row count itself
    (tests/unit/test_native_ops.py)."""
    if not prepacked_available(torch.zeros(2, 2)):
        pytest.skip("this torch build has no MKL / oneDNN")
    monkeypatch.setattr(linear, "LARGE_PRODUCT", product)
    gen = torch.Generator().manual_seed(7)
    weight, bias = torch.randn(960, 576, generator=gen), torch.randn(960, generator=gen)
    layer = PreparedLinear(weight, bias, kernel)
    expect = F.linear if product == "mkl" else onednn_linear
    for rows in (LARGE_ROWS + 1, 300):
        x = torch.randn(rows, 576, generator=gen)
        got = layer(x)
        assert torch.equal(got, expect(x, weight, bias))
        torch.testing.assert_close(got, F.linear(x, weight, bias), atol=1e-4, rtol=1e-5)
    # up to LARGE_ROWS the prepacked kernel is oneDNN's, not F.linear
    x = torch.randn(LARGE_ROWS, 576, generator=gen)
    got = PreparedLinear(weight, bias, "prepacked")(x)
    assert not torch.equal(got, F.linear(x, weight, bias))
    torch.testing.assert_close(got, F.linear(x, weight, bias), atol=1e-4, rtol=1e-5)


def test_large_product_is_mkl_on_intel_only(tmp_path: Path) -> None:
    for vendor, product in (("GenuineIntel", "mkl"), ("AuthenticAMD", "onednn"), ("HygonGenuine", "onednn")):
        info = tmp_path / vendor
        info.write_text(f"processor\t: 0\nvendor_id\t: {vendor}\ncpu family\t: 26\n")
        assert linear.cpu_vendor(str(info)) == vendor
        assert linear.large_product(vendor) == product
    assert linear.cpu_vendor(str(tmp_path / "missing")) == ""
    assert linear.large_product("") == "mkl"
    assert linear.large_product("GenuineIntel", "onednn") == "onednn"
    assert linear.large_product("AuthenticAMD", "mkl") == "mkl"
    assert linear.large_product("AuthenticAMD", "auto") == "onednn"
    with pytest.raises(ValueError, match="large_product must be mkl or onednn"):
        linear.large_product("AuthenticAMD", "openblas")


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


def test_workers_get_threads_and_huge_pages_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """The prompt chunks' product travels in the engine config every worker gets, not the environment."""
    from cluster.workers import worker_env

    monkeypatch.setenv("PDSERVE_LARGE_PRODUCT", "onednn")
    monkeypatch.delenv("THP_MEM_ALLOC_ENABLE", raising=False)
    assert worker_env(2) == {"OMP_NUM_THREADS": "2", "THP_MEM_ALLOC_ENABLE": "1"}

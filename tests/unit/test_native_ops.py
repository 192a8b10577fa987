"""The native small ops and the packed product (``kernels/native_ops.py``) against the torch expressions."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.activation import silu_mul
from kernels.linear import LARGE_ROWS, PreparedLinear
from kernels.native_ops import PANEL, NativeOps, native_ops
from kernels.norm import rms_norm
from kernels.rope import apply_rotary

pytestmark = pytest.mark.skipif(native_ops() is None, reason="native CPU kernels cannot be built here")


def ops() -> NativeOps:
    found = native_ops()
    assert found is not None
    return found


@pytest.mark.parametrize(("rows", "dim"), [(1, 576), (3, 13), (70, 40)])  # 70 rows: the threaded path
@pytest.mark.parametrize("with_delta", [False, True])
def test_add_rms_norm(rows: int, dim: int, with_delta: bool) -> None:
    gen = torch.Generator().manual_seed(rows * dim)
    hidden = torch.randn(rows, dim, generator=gen)
    delta = torch.randn(rows, dim, generator=gen) if with_delta else None
    weight = torch.randn(dim, generator=gen)
    summed = hidden + delta if delta is not None else hidden.clone()
    out = ops().add_rms_norm(hidden, delta, weight, 1e-5)
    assert torch.equal(hidden, summed)  # the residual add: in place, bitwise torch's
    torch.testing.assert_close(out, rms_norm(summed, weight, 1e-5), atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize(("tokens", "head_dim"), [(1, 64), (5, 16), (66, 128), (3, 20)])
def test_rope_is_bitwise_apply_rotary(tokens: int, head_dim: int) -> None:
    gen = torch.Generator().manual_seed(tokens)
    qkv = torch.randn(tokens, 15, head_dim, generator=gen)
    cos = torch.randn(tokens, 1, head_dim, generator=gen)
    sin = torch.randn(tokens, 1, head_dim, generator=gen)
    expected = apply_rotary(qkv[:, :12], cos, sin)
    untouched = qkv[:, 12:].clone()
    ops().rope_(qkv, cos, sin, 12)
    assert torch.equal(qkv[:, :12], expected)
    assert torch.equal(qkv[:, 12:], untouched)


@pytest.mark.parametrize(("rows", "inter"), [(1, 1536), (17, 37)])
def test_silu_mul(rows: int, inter: int) -> None:
    gate_up = torch.randn(rows, 2 * inter, generator=torch.Generator().manual_seed(inter)) * 6
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # saturation at both ends
    torch.testing.assert_close(ops().silu_mul(gate_up), silu_mul(gate_up), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize(("out_f", "in_f"), [(960, 576), (13, 40), (131, 7), (1000, 1536)])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 16, 17])  # 3-row groups and the 2- and 1-row tails
@pytest.mark.parametrize("threads", [1, 2])
def test_linear_matches_f_linear(out_f: int, in_f: int, rows: int, threads: int) -> None:
    gen = torch.Generator().manual_seed(out_f * 31 + in_f + rows)
    weight = torch.randn(out_f, in_f, generator=gen)
    bias = torch.randn(out_f, generator=gen) if rows % 2 else None
    x = torch.randn(rows, in_f, generator=gen)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = ops().linear(x, weight, bias)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(got, F.linear(x, weight, bias), atol=1e-4, rtol=1e-5)


def test_pack_lays_out_panels_of_16_features() -> None:
    weight = torch.randn(37, 5)
    packed = ops().pack(weight)
    assert packed.shape == (3, 5, PANEL) == NativeOps.packed_shape(37, 5)
    for feature in range(37):
        assert torch.equal(packed[feature // PANEL, :, feature % PANEL], weight[feature])
    assert not packed[2, :, 37 - 2 * PANEL:].any()  # the last panel's padding


@pytest.mark.parametrize("rows", [0, 1, 5, LARGE_ROWS + 1, 300])
def test_native_linear_kernel_packs_once(rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    weight, bias = torch.randn(100, 40, generator=gen), torch.randn(100, generator=gen)
    layer = PreparedLinear(weight, bias, "native")
    assert layer.kernel == "native" and layer.packed is not None
    assert layer.extra_bytes == 7 * 40 * PANEL * 4  # ceil(100 / 16) panels
    x = torch.randn(rows, 40, generator=gen)
    torch.testing.assert_close(layer(x), F.linear(x, weight, bias), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("out_f", "in_f"), [(832, 576), (100, 1536), (50000, 64)])
def test_a_rows_product_depends_on_that_row_only(out_f: int, in_f: int) -> None:
    """Each output is one FMA chain over the inputs: the same bits whatever the row count (a decode step
    of 1 or 16 rows, a prompt chunk of 200), the other rows and the thread count."""
    gen = torch.Generator().manual_seed(out_f + in_f)
    weight, bias = torch.randn(out_f, in_f, generator=gen), torch.randn(out_f, generator=gen)
    layer = PreparedLinear(weight, bias, "native")
    x = torch.randn(200, in_f, generator=gen)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        whole = layer(x)
        torch.set_num_threads(1)
        assert torch.equal(layer(x), whole)
        for start, stop in ((0, 1), (7, 23), (150, 200), (3, 4)):
            assert torch.equal(layer(x[start:stop]), whole[start:stop])
        torch.set_num_threads(2)
        assert torch.equal(layer(x[40:56].flip(0)), whole[40:56].flip(0))
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(whole, F.linear(x, weight, bias), atol=2e-4, rtol=1e-5)



"""The greedy head (kernels/greedy_head.py): the tokens the full float32 LM head picks, bitwise, from a
half-precision screen and an exact recheck of the candidates."""

from __future__ import annotations

import ctypes

import pytest
import torch

from kernels.greedy_head import MAX_CANDIDATES, MAX_ROWS, GreedyHead
from kernels.linear import PreparedLinear
from kernels.native_ops import native_ops

pytestmark = pytest.mark.skipif(native_ops() is None, reason="native kernels unavailable")

VOCAB, HIDDEN = 4096, 576


def head_for(weight: torch.Tensor) -> tuple[GreedyHead, PreparedLinear]:
    linear = PreparedLinear(weight, None, "native")
    head = GreedyHead.build(linear)
    assert head is not None
    return head, linear


def full_argmax(linear: PreparedLinear, x: torch.Tensor) -> torch.Tensor:
    return linear(x).argmax(dim=-1)


@pytest.fixture(scope="module")
def weight() -> torch.Tensor:
    return torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(0)) * 0.05


def test_tokens_equal_the_full_products_argmax_for_every_row_count(weight: torch.Tensor) -> None:
    head, linear = head_for(weight)
    gen = torch.Generator().manual_seed(1)
    for rows in [1, 2, 3, 4, 5, 7, 9, 12, 15, 16]:
        for scale in (0.3, 1.0, 8.0):
            x = torch.randn(rows, HIDDEN, generator=gen) * scale
            got = head.argmax(x)
            assert got is not None
            assert torch.equal(got, full_argmax(linear, x)), (rows, scale)
    assert head.fallbacks == 0 and head.steps == 30
    assert head.argmax(torch.randn(MAX_ROWS + 1, HIDDEN)) is None  # the full product is faster there


def test_the_screen_stays_within_its_bound(weight: torch.Tensor) -> None:
    """|screen - float32 product| <= |x| c_r for every feature: the inequality the exactness rests on."""
    head, linear = head_for(weight)
    ops = native_ops()
    assert ops is not None
    gen = torch.Generator().manual_seed(2)
    for rows in (1, 3, 8):
        x = torch.randn(rows, HIDDEN, generator=gen) * 4
        y = x.new_empty(rows, VOCAB)
        head._screen(head.half.data_ptr(), x.data_ptr(), y.data_ptr(), rows, VOCAB, HIDDEN, 1)
        exact = linear(x)
        bound = x.double().norm(dim=1, keepdim=True) * head.coefficients.double()
        err = (y.double() - exact.double()).abs()
        assert bool((err <= bound).all())
        assert float((err / bound).max()) < 0.5  # the bound is loose, not empty: the screen is real
        assert float(err.max()) > 0  # the half copy does differ from the float32 weight


def test_near_ties_the_half_copy_cannot_tell_apart_are_decided_exactly(weight: torch.Tensor) -> None:
    w = weight.clone()
    gen = torch.Generator().manual_seed(3)
    direction = torch.randn(HIDDEN, generator=gen)
    base = direction / direction.norm() * 2.0
    w[100] = base
    w[2000] = base
    w[2000, :8] = torch.nextafter(base[:8], torch.full((8,), 10.0))  # a few ulps apart: the same halves
    w[3000] = base  # an exact tie with row 100: the lowest id wins, as torch.argmax picks
    assert torch.equal(w[100].half(), w[2000].half())
    head, linear = head_for(w)
    for sign in (1.0, -1.0):
        x = (direction * sign + torch.randn(HIDDEN, generator=gen) * 1e-3).unsqueeze(0).repeat(3, 1)
        x[0, :8] = x[0, :8].abs() * 50  # row 0 prefers the perturbed row 2000
        expected = full_argmax(linear, x)
        got = head.argmax(x)
        assert got is not None and torch.equal(got, expected)
        if sign > 0:
            assert expected[0].item() == 2000 and expected[1].item() == 100
            assert head.candidates >= 3  # rows 100, 2000 and 3000 were rechecked


def test_refuses_what_it_cannot_promise(weight: torch.Tensor) -> None:
    head, _ = head_for(weight)
    x = torch.randn(2, HIDDEN)
    x[1, 5] = float("nan")
    assert head.argmax(x) is None
    x[1, 5] = float("inf")
    assert head.argmax(x) is None
    assert head.argmax(torch.zeros(1, HIDDEN)) is None  # |x| under 1e-10: no bound without underflow
    same, _ = head_for(weight[:1].repeat(VOCAB, 1).contiguous())  # every feature ties: too many candidates
    assert same.argmax(torch.randn(1, HIDDEN)) is None and same.fallbacks == 1
    found = torch.empty(MAX_CANDIDATES + 3, dtype=torch.int64)
    y, ones = torch.zeros(1, VOCAB), torch.ones(1, HIDDEN)
    count = same._candidates(y.data_ptr(), same.coefficients.data_ptr(), ones.data_ptr(), 1, VOCAB, HIDDEN,
                             ctypes.c_void_p(found.data_ptr()), MAX_CANDIDATES)
    assert count == -2
    assert head.fallbacks == 3


def test_built_only_where_its_promise_holds(weight: torch.Tensor, monkeypatch: pytest.MonkeyPatch) -> None:
    assert GreedyHead.build(PreparedLinear(weight, None, "plain")) is None
    assert GreedyHead.build(PreparedLinear(weight, torch.zeros(VOCAB), "native")) is None
    assert GreedyHead.build(PreparedLinear(weight[:, :32].contiguous(), None, "native")) is None
    huge = weight.clone()
    huge[7, 7] = 1e6  # beyond half precision
    assert GreedyHead.build(PreparedLinear(huge, None, "native")) is None


def test_a_vocabulary_tail_outside_whole_panels_is_exact_too() -> None:
    """A vocabulary that is not a multiple of the packed panels (1026 = 64 x 16 + 2): a winner in the
    last, zero-padded panel is still found bitwise (each logit depends on its weight row alone)."""
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(1026, HIDDEN, generator=gen) * 0.05
    head, linear = head_for(w)
    x = torch.randn(4, HIDDEN, generator=gen)
    got = head.argmax(x)
    assert got is not None and torch.equal(got, full_argmax(linear, x))
    x[0] = w[1025] * 100  # row 0's winner is the last feature
    assert int(full_argmax(linear, x)[0]) == 1025
    got = head.argmax(x)
    assert got is not None and torch.equal(got, full_argmax(linear, x)) and head.fallbacks == 0

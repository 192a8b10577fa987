"""Sampler tests: greedy, seeded draws, filters, penalties, min_tokens, logprobs, validation."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from engine.sampling import (
    Sampler,
    SamplingParams,
    SamplingState,
    apply_penalties,
    invert,
)

VOCAB = 64


def _state(prompt: list[int] | None = None, eos: tuple[int, ...] = (), **kwargs: Any) -> SamplingState:
    return SamplingState(SamplingParams(**kwargs), prompt or [1, 2, 3], eos_token_ids=eos)


def _step_logits(steps: int, rows: int = 1, vocab: int = VOCAB) -> list[torch.Tensor]:
    torch.manual_seed(1234)
    return [torch.randn(rows, vocab) for _ in range(steps)]


def _run(sampler: Sampler, states: list[SamplingState], logits: list[torch.Tensor]) -> list[list[int]]:
    """Sample every step, appending tokens to the states; returns per-state sequences."""
    for step in logits:
        out = sampler.sample(step, states)
        for state, token in zip(states, out.token_ids, strict=True):
            state.output_token_ids.append(token)
    return [list(s.output_token_ids) for s in states]


def test_greedy_equals_argmax() -> None:
    logits = torch.randn(5, VOCAB)
    logits[0, 7] = logits[0, 3] = logits[0].max() + 1.0
    out = Sampler().sample(logits, [_state(temperature=0.0) for _ in range(5)])
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert out.token_ids[0] == 3
    assert out.logprobs == [None] * 5


def test_greedy_rows_in_mixed_batch_take_argmax() -> None:
    logits = torch.randn(4, VOCAB)
    states = [_state(temperature=0.0), _state(seed=1), _state(temperature=0.0), _state(seed=2)]
    out = Sampler().sample(logits, states)
    assert out.token_ids[0] == int(logits[0].argmax())
    assert out.token_ids[2] == int(logits[2].argmax())


def test_seed_reproducible_regardless_of_batch_neighbours() -> None:
    sampler = Sampler()
    steps = _step_logits(20, rows=3)
    alone = _run(sampler, [_state(seed=7)], [s[:1] for s in steps])[0]
    neighbours = [_state(seed=99, top_p=0.9), _state(seed=7), _state(temperature=0.0)]
    batched = _run(sampler, neighbours, [s[[2, 0, 1]] for s in steps])[1]
    other_seed = _run(sampler, [_state(seed=8)], [s[:1] for s in steps])[0]
    assert len(alone) == 20
    assert batched == alone
    assert other_seed != alone


def test_draw_inverts_the_distribution_with_one_uniform_per_row() -> None:
    """Each row takes one float64 uniform from its own seeded generator, and the token is the first whose
    float64 running sum of the probabilities exceeds it (times the row's sum)."""
    steps = _step_logits(25, rows=2, vocab=50_000)
    states = [_state(seed=11, temperature=0.7), _state(seed=12)]
    got = _run(Sampler(), states, steps)
    for row, (seed, temperature) in enumerate(((11, 0.7), (12, 1.0))):
        generator = torch.Generator().manual_seed(seed)
        want = []
        for step in steps:
            probs = (step[row] / temperature).softmax(-1).double()
            u = torch.rand(1, dtype=torch.float64, generator=generator).item()
            cdf = probs.cumsum(-1)
            want.append(int((cdf <= u * cdf[-1]).sum()))
        assert got[row] == want


def test_draw_never_returns_a_zero_probability_id() -> None:
    """Mass at the ends of the vocabulary and on one id between zeros; uniforms at the edges of [0, 1)."""
    probs = torch.zeros(3, 1000)
    probs[0, 0] = probs[1, 999] = 1.0
    probs[2, 500] = 0.25
    probs[2, 501] = 0.75
    for u in (0.0, 0.25 - 2.0 ** -54, 0.25, 0.5, 1.0 - 2.0 ** -53):
        picked = invert(probs, torch.full((3,), u, dtype=torch.float64)).tolist()
        assert picked == [0, 999, 500 if u < 0.25 else 501], u


def test_a_seeded_request_continues_where_another_engine_left_it() -> None:
    """A decode worker's state arrives holding the token its prefill worker sampled: it draws the uniforms
    one engine running the whole request would have drawn, so the tokens are the same either way."""
    steps = _step_logits(8, rows=1, vocab=1000)
    whole = _run(Sampler(), [_state(seed=5)], steps)[0]
    first = _run(Sampler(), [_state(seed=5)], steps[:1])[0]
    continued = _state(seed=5)
    continued.output_token_ids.extend(first)
    assert _run(Sampler(), [continued], steps[1:])[0] == whole


def test_unseeded_requests_differ() -> None:
    steps = [torch.zeros(2, VOCAB) for _ in range(20)]
    first, second = _run(Sampler(), [_state(), _state()], steps)
    assert first != second


def test_top_k_one_equals_greedy() -> None:
    steps = _step_logits(30, rows=2)
    top1, greedy = _run(Sampler(), [_state(top_k=1, temperature=1.5, seed=3), _state(temperature=0.0)], steps)
    assert top1 == [int(s[0].argmax()) for s in steps]
    assert greedy == [int(s[1].argmax()) for s in steps]


def _draw_many(logits: torch.Tensor, draws: int, **kwargs: Any) -> list[int]:
    """``draws`` samples from one logits row, as a batch of distinctly seeded requests."""
    states = [_state(seed=i, **kwargs) for i in range(draws)]
    return Sampler().sample(logits.expand(draws, -1).clone(), states).token_ids


PROBS = torch.tensor([0.5, 0.3, 0.15, 0.05])


def test_top_p_tiny_keeps_only_top_token() -> None:
    logits = torch.tensor([0.1, 0.3, 0.2, 0.25])
    assert set(_draw_many(logits, 500, top_p=1e-6)) == {1}


def test_top_p_keeps_smallest_nucleus() -> None:
    assert set(_draw_many(PROBS.log(), 2000, top_p=0.7)) == {0, 1}


def test_top_k_keeps_k_best() -> None:
    assert set(_draw_many(PROBS.log(), 2000, top_k=3)) == {0, 1, 2}


def test_min_p_drops_tokens_below_fraction_of_max() -> None:
    assert set(_draw_many(PROBS.log(), 3000, min_p=0.2)) == {0, 1, 2}
    assert set(_draw_many(PROBS.log(), 3000, min_p=0.5)) == {0, 1}
    assert set(_draw_many(PROBS.log(), 3000)) == {0, 1, 2, 3}


@pytest.mark.parametrize("temperature", [0.5, 1.0, 1.7])
def test_temperature_frequencies_match_scaled_softmax(temperature: float) -> None:
    logits = torch.tensor([1.0, 2.0, 0.5, 3.0])
    draws = 20000
    tokens = torch.tensor(_draw_many(logits, draws, temperature=temperature))
    frequencies = torch.bincount(tokens, minlength=4).float() / draws
    expected = torch.softmax(logits / temperature, dim=-1)
    assert torch.allclose(frequencies, expected, atol=0.015), (frequencies, expected)


def test_penalties_change_logits_by_exact_amounts() -> None:
    logits = torch.tensor([[2.0, 4.0, -1.0, 3.0, -2.0, 1.0], [2.0, 4.0, -1.0, 3.0, -2.0, 1.0]])
    original = logits.clone()
    penalised_state = SamplingState(
        SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25),
        prompt_token_ids=[1, 4],
        output_token_ids=[2, 3, 3],
    )
    plain_state = SamplingState(SamplingParams(), prompt_token_ids=[1, 4], output_token_ids=[2, 3, 3])
    out = apply_penalties(logits, [penalised_state, plain_state])
    # token 1 (prompt, positive): 4 / 2; token 4 (prompt, negative): -2 * 2;
    # token 2 (output once, negative): -1 * 2 - 0.5 - 0.25; token 3 (twice): 3 / 2 - 0.5 - 0.5.
    expected = torch.tensor([2.0, 2.0, -2.75, 0.5, -4.0, 1.0])
    assert torch.equal(out[0], expected)
    assert torch.equal(out[1], original[1])
    assert torch.equal(logits, original)


def test_presence_and_frequency_ignore_prompt_tokens() -> None:
    logits = torch.zeros(1, 8)
    state = SamplingState(
        SamplingParams(presence_penalty=1.0, frequency_penalty=-0.5), [5, 5, 6], output_token_ids=[6, 7, 7]
    )
    out = apply_penalties(logits, [state])[0]
    assert out.tolist() == [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, -0.5, 0.0]


def test_no_penalties_returns_input_unchanged() -> None:
    logits = torch.randn(2, VOCAB)
    assert apply_penalties(logits, [_state(), _state()]) is logits


def test_repetition_penalty_steers_sampling() -> None:
    logits = torch.tensor([[0.0, 5.0, 4.0, -1.0]])
    state = SamplingState(SamplingParams(temperature=0.0, repetition_penalty=2.0), [1])
    assert Sampler().sample(logits, [state]).token_ids == [2]


def test_min_tokens_masks_eos_and_stop_ids() -> None:
    logits = torch.zeros(1, 8)
    logits[0, 0] = 100.0  # eos
    logits[0, 5] = 50.0  # stop id
    logits[0, 3] = 10.0
    sampler = Sampler()
    state = _state(eos=(0,), temperature=0.0, min_tokens=3, stop_token_ids=[5])
    assert _run(sampler, [state], [logits] * 4)[0] == [3, 3, 3, 0]
    ignoring = _state(eos=(0,), temperature=0.0, min_tokens=2, ignore_eos=True, stop_token_ids=[5])
    assert _run(sampler, [ignoring], [logits] * 2)[0] == [0, 0]
    sampled = _state(eos=(0,), seed=0, min_tokens=5, stop_token_ids=[5])
    assert 0 not in _run(sampler, [sampled], [logits] * 5)[0]


def test_logprobs_equal_log_softmax_before_temperature() -> None:
    logits = torch.randn(3, VOCAB)
    states = [_state(logprobs=5, temperature=0.5, seed=1), _state(logprobs=0, temperature=0.0), _state()]
    out = Sampler().sample(logits, states)
    expected = torch.log_softmax(logits, dim=-1)
    first = out.logprobs[0]
    assert first is not None
    assert first.token_id == out.token_ids[0]
    assert first.logprob == pytest.approx(expected[0, first.token_id].item(), abs=1e-6)
    assert len(first.top) == 5
    assert [t for t, _ in first.top] == expected[0].topk(5).indices.tolist()
    values = [v for _, v in first.top]
    assert values == sorted(values, reverse=True)
    for token, value in first.top:
        assert value == pytest.approx(expected[0, token].item(), abs=1e-6)
    second = out.logprobs[1]
    assert second is not None and second.top == []
    assert second.logprob == pytest.approx(expected[1].max().item(), abs=1e-6)
    assert out.logprobs[2] is None


def test_logprobs_follow_penalised_logits() -> None:
    logits = torch.randn(1, VOCAB)
    state = SamplingState(SamplingParams(logprobs=3, presence_penalty=1.5, temperature=0.0), [0], [4, 9])
    expected = torch.log_softmax(apply_penalties(logits, [state]), dim=-1)[0]
    result = Sampler().sample(logits, [state]).logprobs[0]
    assert result is not None
    assert result.logprob == pytest.approx(expected[result.token_id].item(), abs=1e-6)
    assert [t for t, _ in result.top] == expected.topk(3).indices.tolist()


def test_params_normalise_and_greedy_property() -> None:
    params = SamplingParams(stop_token_ids=[3, 4])  # type: ignore[arg-type]
    assert params.stop_token_ids == (3, 4)
    assert SamplingParams(temperature=0.0).greedy
    assert SamplingParams(top_k=1).greedy
    assert not SamplingParams(top_k=-1).greedy
    assert SamplingParams(max_tokens=None, top_k=-1, logprobs=20).max_tokens is None


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("n", 0),
        ("max_tokens", 0),
        ("min_tokens", -1),
        ("temperature", -0.1),
        ("temperature", 2.5),
        ("temperature", math.nan),
        ("top_k", -2),
        ("top_p", 0.0),
        ("top_p", 1.1),
        ("min_p", -0.1),
        ("min_p", 1.5),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -2.1),
        ("repetition_penalty", 0.0),
        ("logprobs", -1),
        ("logprobs", 21),
        ("seed", 1.5),
        ("stop_token_ids", (1, -3)),
    ],
)
def test_out_of_range_values_name_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})  # type: ignore[arg-type]


def test_min_tokens_cannot_exceed_max_tokens() -> None:
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=5, max_tokens=4)

"""Speculative decoding in the engine on the tiny random model: exact tokens against decoding without
speculation, block counts after every step, preemption and aborts, the adaptive pause, counters; n-gram
proposals and a draft model's."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from engine import LLM, SamplingParams
from engine.engine import LLMEngine
from engine.outputs import RequestOutput
from tests.unit.conftest import save_tiny_llama

NGRAM: dict[str, Any] = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
                         "prompt_lookup_max": 3}


def copy_prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prompts = []
    for i in range(n):
        seg = [rng.randrange(1, 256) for _ in range(8 + i)]
        prompts.append(seg * 3 + seg[:3])
    return prompts


def make(model: Path, spec: dict[str, Any] | None, **kw: Any) -> LLM:
    args: dict[str, Any] = {"block_size": 4, "num_kv_blocks": 400, "max_num_batched_tokens": 64, **kw}
    return LLM(str(model), check_integrity=True, speculative_config=spec, **args)


def check_blocks(engine: LLMEngine) -> None:
    """Each running request holds exactly the blocks its computed tokens need (as without speculation)."""
    kv = engine.kv
    for r in engine.scheduler.running:
        assert len(kv.blocks_of(r.request_id)) == kv.blocks_needed(r.kv_tokens), r.request_id


def run(llm: LLM, prompts: list[list[int]],
        params: SamplingParams | list[SamplingParams]) -> list[RequestOutput]:
    per = params if isinstance(params, list) else [params] * len(prompts)
    engine = llm.engine
    ids = [engine.add_request(p, sp).request_id for p, sp in zip(prompts, per, strict=True)]
    done: dict[str, RequestOutput] = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        check_blocks(engine)
    assert engine.kv.pool.num_used_blocks == 0
    return [done[i] for i in ids]


def step_with(engine: LLMEngine, drafts: dict[str, list[int]]) -> list[RequestOutput]:
    """One engine step with the given proposals (instead of the n-gram proposer's)."""
    out = engine.scheduler.schedule(drafts)
    outputs = engine.process(out, engine.sample(out, engine.runner.execute(out, engine.kv)))
    engine.kv.check_integrity()
    check_blocks(engine)
    return outputs


@pytest.fixture(scope="module")
def greedy_reference(tiny_model_dir: Path) -> list[list[int]]:
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    return [o.token_ids for o in run(make(tiny_model_dir, None), copy_prompts(5), params)]


def test_greedy_tokens_equal_without_speculation(
    tiny_model_dir: Path, greedy_reference: list[list[int]]
) -> None:
    llm = make(tiny_model_dir, NGRAM)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    assert [o.token_ids for o in run(llm, copy_prompts(5), params)] == greedy_reference
    spec = llm.engine.stats().spec
    assert spec is not None and spec.num_drafts > 0 and spec.num_accepted_tokens > 0
    assert spec.num_accepted_tokens == sum(spec.accepted_per_pos) <= spec.num_draft_tokens


def test_right_proposals_are_all_accepted_and_wrong_ones_all_rejected(
    tiny_model_dir: Path, greedy_reference: list[list[int]]
) -> None:
    llm = make(tiny_model_dir, NGRAM, enable_prefix_caching=False)
    engine = llm.engine
    prompt, expected = copy_prompts(5)[0], greedy_reference[0]
    req = engine.add_request(prompt, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    while not req.output_token_ids:
        step_with(engine, {})
    k = 4
    n = len(req.output_token_ids)
    outs = step_with(engine, {req.request_id: expected[n:n + k]})  # the right continuation: all kept
    assert outs[0].new_token_ids == expected[n:n + k + 1]
    assert req.num_computed_tokens == req.num_tokens - 1
    n = len(req.output_token_ids)
    wrong = [(t + 1) % 256 for t in expected[n:n + k]]
    outs = step_with(engine, {req.request_id: wrong})  # the first one is wrong: only the model's token
    assert outs[0].new_token_ids == [expected[n]]
    free = engine.kv.num_free_blocks
    assert len(engine.kv.blocks_of(req.request_id)) == engine.kv.blocks_needed(req.num_tokens - 1)
    while engine.has_unfinished():
        step_with(engine, {})
    assert req.output_token_ids == expected and engine.kv.num_free_blocks > free
    spec = engine.stats().spec
    assert spec is not None
    assert (spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens) == (2, 8, 4)
    assert spec.accepted_per_pos == [1, 1, 1, 1]
    assert req.metrics.spec_draft_tokens == 8 and req.metrics.spec_accepted_tokens == 4


def test_max_tokens_and_stop_tokens_cut_accepted_tokens(
    tiny_model_dir: Path, greedy_reference: list[list[int]]
) -> None:
    llm = make(tiny_model_dir, NGRAM)
    engine = llm.engine
    expected = greedy_reference[1]
    stop = expected[7]
    a = engine.add_request(copy_prompts(5)[1], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    b = engine.add_request(copy_prompts(5)[1], SamplingParams(max_tokens=20, temperature=0.0,
                                                             stop_token_ids=(stop,)))
    while not b.output_token_ids:
        step_with(engine, {})
    while engine.has_unfinished():
        drafts = {r.request_id: expected[len(r.output_token_ids):len(r.output_token_ids) + 4]
                  for r in engine.scheduler.running}
        step_with(engine, drafts)
    assert a.output_token_ids == expected[:6] and a.finish_reason == "length"
    assert b.output_token_ids == expected[:expected.index(stop) + 1] and b.finish_reason == "stop"
    assert engine.kv.pool.num_used_blocks == 0


def test_sampled_tokens_logprobs_and_penalties_match_without_speculation(tiny_model_dir: Path) -> None:
    prompts = copy_prompts(4, seed=1)
    params = [SamplingParams(max_tokens=20, temperature=0.8, seed=11, ignore_eos=True),
              SamplingParams(max_tokens=20, temperature=0.0, logprobs=3, repetition_penalty=1.3,
                             ignore_eos=True),
              SamplingParams(max_tokens=20, temperature=1.0, top_k=20, seed=5, presence_penalty=0.5,
                             frequency_penalty=0.3, logprobs=2, ignore_eos=True),
              SamplingParams(max_tokens=20, temperature=0.0, min_tokens=10, stop_token_ids=(prompts[3][3],))]
    plain = run(make(tiny_model_dir, None), prompts, params)
    llm = make(tiny_model_dir, NGRAM)
    spec = run(llm, prompts, params)
    again = run(make(tiny_model_dir, NGRAM), prompts, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain] == [o.token_ids for o in again]
    for s, p in zip(spec, plain, strict=True):
        assert (s.logprobs is None) == (p.logprobs is None)
        for a, b in zip(s.logprobs or [], p.logprobs or [], strict=True):
            assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=1e-4)
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
    stats = llm.engine.stats().spec
    assert stats is not None and stats.num_drafts > 0


def test_preemption_and_aborts_keep_the_pool_whole(tiny_model_dir: Path) -> None:
    prompts = copy_prompts(4, seed=2)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    ample = [o.token_ids for o in run(make(tiny_model_dir, None), prompts, params)]
    for mode in ("recompute", "swap"):
        llm = make(tiny_model_dir, NGRAM, num_kv_blocks=26, preemption_mode=mode)
        assert [o.token_ids for o in run(llm, prompts, params)] == ample
        assert llm.engine.stats().num_preemptions > 0
    llm = make(tiny_model_dir, NGRAM)
    engine = llm.engine
    reqs = [engine.add_request(p, params) for p in prompts]
    for i in range(12):
        engine.step()
        check_blocks(engine)
        if i % 3 == 2:
            engine.abort_request(reqs[i // 3].request_id)
            engine.kv.check_integrity()
    assert not engine.has_unfinished() or all(r.is_finished for r in reqs)
    assert engine.kv.pool.num_used_blocks == 0


def test_low_acceptance_pauses_speculation(tiny_model_dir: Path) -> None:
    llm = make(tiny_model_dir, {**NGRAM, "min_acceptance": 0.5})
    engine = llm.engine
    rng = random.Random(3)
    prompt = [rng.randrange(1, 256) for _ in range(40)]
    req = engine.add_request(prompt, SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True))
    spec = engine.spec
    assert spec is not None
    proposed: list[int] = []
    while engine.has_unfinished():
        if req.num_tokens - req.num_computed_tokens != 1:  # still prefilling
            step_with(engine, {})
            continue
        k = spec.budget(req)  # what the proposer may propose this step
        proposed.append(k)
        wrong = [(t + 1) % 256 for t in req.all_token_ids[-k:]] if k else []
        step_with(engine, {req.request_id: wrong} if k else {})
    # every proposal was wrong: K shrinks, then speculation pauses, for longer each time
    assert spec.stats.num_accepted_tokens == 0 and spec.stats.num_drafts > 2
    assert proposed[:2] == [4, 3] and max(proposed[2:]) <= 2
    assert proposed.count(0) > len(proposed) // 2


PERTURB = 0.01


def draft_spec(model: Path, k: int = 4) -> dict[str, Any]:
    return {"method": "draft_model", "model": str(model), "num_speculative_tokens": k}


def test_draft_model_as_its_own_draft_accepts_every_proposal(
        tiny_model_dir: Path, greedy_reference: list[list[int]]) -> None:
    llm = make(tiny_model_dir, draft_spec(tiny_model_dir))
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    assert [o.token_ids for o in run(llm, copy_prompts(5), params)] == greedy_reference
    spec = llm.engine.spec
    assert spec is not None and spec.draft is not None
    assert spec.stats.num_draft_tokens >= 5 * 16
    assert spec.stats.num_accepted_tokens == spec.stats.num_draft_tokens
    assert spec.draft.kv.pool.num_used_blocks == 0  # finished requests' draft K/V freed


def test_a_different_draft_model_keeps_greedy_tokens_and_frees_its_kv(
        tiny_model_dir: Path, greedy_reference: list[list[int]], tmp_path: Path) -> None:
    """A draft with perturbed weights is sometimes wrong: tokens still equal decoding without speculation,
    blocks stay exact after every step, and aborted requests' draft K/V is freed at once."""
    draft_dir = save_tiny_llama(tmp_path / "draft", perturb=PERTURB)
    llm = make(tiny_model_dir, draft_spec(draft_dir, k=3) | {"min_acceptance": 0.0})
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    assert [o.token_ids for o in run(llm, copy_prompts(5), params)] == greedy_reference
    spec = llm.engine.spec
    assert spec is not None and spec.draft is not None
    assert 0 < spec.stats.num_accepted_tokens < spec.stats.num_draft_tokens
    engine = llm.engine
    ids = [engine.add_request(p, params).request_id for p in copy_prompts(3, seed=1)]
    for _ in range(4):
        engine.step()
    assert spec.draft.kv.pool.num_used_blocks > 0
    for request_id in ids:
        engine.abort_request(request_id)
    assert spec.draft.kv.pool.num_used_blocks == 0 and engine.kv.pool.num_used_blocks == 0
    spec.draft.kv.check_integrity()


def test_draft_model_with_another_vocabulary_is_refused(tiny_model_dir: Path, tmp_path: Path) -> None:
    draft_dir = save_tiny_llama(tmp_path / "draft", seed=7, vocab_size=300)
    with pytest.raises(ValueError, match="vocabulary of 300 tokens"):
        make(tiny_model_dir, draft_spec(draft_dir))

"""Priorities and the two preemption modes (recompute, swap) on the tiny random model."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from engine.config import EngineConfig

PROMPTS = [[(7 * i + j) % 250 + 1 for j in range(20 + 3 * i)] for i in range(4)]
PARAMS = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
TIGHT = 24  # blocks of 4 tokens: the 4 requests need ~50, so some are preempted


def run(model: Path, **kw: object) -> tuple[list[list[int]], LLM]:
    llm = LLM(str(model), block_size=4, max_num_batched_tokens=64, check_integrity=True, **kw)
    return [o.token_ids for o in llm.generate(PROMPTS, PARAMS)], llm


@pytest.fixture(scope="module")
def ample(tiny_model_dir: Path) -> list[list[int]]:
    return run(tiny_model_dir, num_kv_blocks=200)[0]


def test_swap_and_recompute_give_identical_outputs_under_memory_pressure(
    tiny_model_dir: Path, ample: list[list[int]]
) -> None:
    recompute, rllm = run(tiny_model_dir, num_kv_blocks=TIGHT)
    swap, sllm = run(tiny_model_dir, num_kv_blocks=TIGHT, preemption_mode="swap")
    rstats, sstats = rllm.engine.stats(), sllm.engine.stats()
    assert rstats.num_preemptions > 0 and sstats.num_preemptions > 0
    assert sstats.num_swap_outs > 0 and sstats.num_swap_ins == sstats.num_swap_outs
    assert sstats.swap_used_bytes == 0 and rstats.num_swap_outs == 0
    assert swap == recompute == ample


def test_full_swap_space_falls_back_to_recompute(tiny_model_dir: Path, ample: list[list[int]]) -> None:
    tiny_swap, llm = run(tiny_model_dir, num_kv_blocks=TIGHT, preemption_mode="swap", swap_space=1)
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0 and stats.num_swap_outs == 0
    assert tiny_swap == ample


def test_lower_priority_value_runs_first_and_is_preempted_last(tiny_model_dir: Path) -> None:
    llm = LLM(str(tiny_model_dir), block_size=4, num_kv_blocks=24, max_num_seqs=2, check_integrity=True)
    engine = llm.engine
    long = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    low = engine.add_request(PROMPTS[0], long, request_id="low", priority=5)
    high = engine.add_request(PROMPTS[1], long, request_id="high", priority=-1)
    mid = engine.add_request(PROMPTS[2], long, request_id="mid", priority=0)
    assert [r.request_id for r in engine.scheduler.waiting] == ["high", "mid", "low"]
    while engine.has_unfinished():
        engine.step()
    assert high.metrics.num_preemptions == 0
    assert low.metrics.num_preemptions + mid.metrics.num_preemptions > 0
    assert high.metrics.finish_time is not None and low.metrics.finish_time is not None
    assert high.metrics.finish_time < low.metrics.finish_time


def test_bad_preemption_flags() -> None:
    with pytest.raises(ValueError, match="--preemption-mode"):
        EngineConfig(preemption_mode="drop")
    with pytest.raises(ValueError, match="--swap-space"):
        EngineConfig(swap_space=-1)

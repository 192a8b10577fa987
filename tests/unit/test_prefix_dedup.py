"""In-flight prefix dedup on a real engine: a request sharing a prefix that another request is
computing in the same step waits for it and takes it from the cache, with the same outputs."""

from __future__ import annotations

from pathlib import Path

from engine import LLM, SamplingParams
from engine.request import Request

PREFIX = [(13 * j) % 250 + 1 for j in range(512)]  # 32 blocks of 16
PROMPTS = [PREFIX + [7, 8, 9, 10, 11], PREFIX + [20, 21, 22], [100 + j for j in range(40)]]
PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def run(model: Path, wait_tokens: int) -> tuple[list[Request], list[int]]:
    """Submit the three prompts at once; step to the end checking the KV invariants after each step."""
    llm = LLM(str(model), block_size=16, num_kv_blocks=200, max_num_batched_tokens=2048,
              prefix_wait_min_tokens=wait_tokens)
    engine = llm.engine
    reqs = [engine.add_request(p, PARAMS, request_id=f"r{i}") for i, p in enumerate(PROMPTS)]
    first_step: list[int] = []
    while engine.has_unfinished():
        engine.step()
        engine.kv.check_integrity()
        first_step.append(len(engine.scheduler.running))
    assert engine.kv.pool.num_used_blocks == 0
    return reqs, first_step


def test_second_request_of_a_prefix_in_flight_hits_it_and_matches_an_undeferred_run(
        tiny_model_dir: Path) -> None:
    deduped, running = run(tiny_model_dir, wait_tokens=128)
    plain, _ = run(tiny_model_dir, wait_tokens=0)
    a, b, c = deduped
    assert running[0] == 2  # r0 and r2 ran in the first step; r1 waited without holding r2 up
    assert b.metrics.cached_prompt_tokens == 512 and a.metrics.cached_prompt_tokens == 0
    assert c.metrics.cached_prompt_tokens == 0
    assert [r.metrics.cached_prompt_tokens for r in plain] == [0, 0, 0]
    assert [r.output_token_ids for r in deduped] == [r.output_token_ids for r in plain]
    assert all(len(r.output_token_ids) == 6 for r in deduped)

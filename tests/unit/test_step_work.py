"""The engine counts each step in the profile's terms (``engine/step_work.py``), and ``AsyncEngine``'s
step clock keeps the totals per kind beside the steps' wall time (hand-computed cases)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.step_work import StepWork


def test_each_step_counted_as_the_profile_prices_it(tiny_model_dir: Path) -> None:
    # a 10-token prompt and a 6-token one, chunked at 12 tokens a step, 4 tokens out each
    config = EngineConfig(num_kv_blocks=64, block_size=16, max_num_seqs=8, max_num_batched_tokens=12)
    engine = LLMEngine(str(tiny_model_dir), config)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    engine.add_request([j + 1 for j in range(10)], params, request_id="a")
    engine.add_request([j + 20 for j in range(6)], params, request_id="b")
    works: list[StepWork | None] = []
    while engine.has_unfinished():
        engine.step()
        works.append(engine.last_step_work)
    assert works == [
        # a's 10 tokens (10 x (0 + 11 / 2) pairs) and b's first 2 (2 x 1.5)
        StepWork(False, 2, 12, 0, 55.0 + 3.0),
        # a's first decode row (1 x (10 + 1) pairs) beside b's last 4 prompt tokens (4 x (2 + 2.5))
        StepWork(False, 2, 5, 0, 11.0 + 18.0),
        # then decode only: a holds 12, 13 tokens with the one it computes, b 7, 8, 9
        StepWork(True, 2, 2, 12 + 7, 0.0),
        StepWork(True, 2, 2, 13 + 8, 0.0),
        StepWork(True, 1, 1, 9, 0.0),  # a finished with its 4th token
    ]
    engine.step()
    assert engine.last_step_work is None  # nothing scheduled


def test_the_step_clock_sums_the_work_per_kind(tiny_model_dir: Path) -> None:
    config = EngineConfig(num_kv_blocks=64, block_size=16, max_num_seqs=8, max_num_batched_tokens=64)
    aengine = AsyncEngine(LLMEngine(str(tiny_model_dir), config))
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)

    async def main() -> None:
        def add(e: LLMEngine) -> None:
            e.add_request([j + 1 for j in range(20)], params, request_id="r")
            aengine.open_stream("r")

        await aengine.mutate(add)
        async for _ in aengine.stream("r", 30.0):
            pass
        await aengine.stop()

    asyncio.run(main())
    c, w = aengine.clock, aengine.clock.work
    # one prompt step (20 tokens, 20 x 10.5 pairs), then 4 decode steps holding 21, 22, 23, 24 tokens
    assert (c.steps, w.prefill_steps, w.prefill_tokens, w.prefill_attended) == (5, 1, 20, 210.0)
    assert (w.decode_steps, w.decode_rows, w.decode_context) == (4, 4, 21 + 22 + 23 + 24)
    assert w.decode_wall_s + w.prefill_wall_s == pytest.approx(c.wall_s)
    assert w.decode_wall_s > 0 and w.prefill_wall_s > 0

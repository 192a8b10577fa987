"""A caller whose request finished reads the engine before the next step starts.

A prefill worker answers a prompt only after one more read of the engine (the blocks to lease), under
the engine's lock. The engine loop takes that lock again for its next step right after delivering
outputs; if the finished request's caller cannot reach the lock before that, its answer waits a whole
step of other prompts (on this machine, 1.75 s for two 256-token prompts). Here two prompts of a full
step budget each run in two steps, and each caller reads the engine once its stream ends.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.sampling_params import SamplingParams


def test_a_finished_request_reads_the_engine_before_the_next_step(tiny_model_dir: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    config = EngineConfig(num_kv_blocks=64, block_size=16, max_num_seqs=8, max_num_batched_tokens=32)
    engine = LLMEngine(str(tiny_model_dir), config)
    events: list[str] = []
    real_step = engine.step

    def step() -> Any:
        events.append("step")
        return real_step()

    monkeypatch.setattr(engine, "step", step)
    aengine = AsyncEngine(engine)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    async def consume(rid: str) -> None:
        async for _ in aengine.stream(rid, 30.0):
            pass
        await aengine.read(lambda e: events.append(f"read {rid}"))

    def add(e: LLMEngine) -> None:
        for i, rid in enumerate(("a", "b")):
            e.add_request([(5 * i + j) % 250 + 1 for j in range(32)], params, request_id=rid)
            aengine.open_stream(rid)

    async def main() -> None:
        # both in one mutate: the consumers wait on their streams before the first step ends (with two,
        # the loop, queued on the lock while the first ran on the engine thread, steps in between)
        await aengine.mutate(add)
        await asyncio.wait_for(asyncio.gather(consume("a"), consume("b")), 60)
        await aengine.stop()

    asyncio.run(main())
    assert events == ["step", "read a", "step", "read b"]

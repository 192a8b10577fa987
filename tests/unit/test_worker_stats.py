"""A worker's stats are read between engine steps, never while a step runs in its thread.

The engine steps in a worker thread (``AsyncEngine``); ``stats`` is called from the
event loop (the router polls it every 100 ms). A read straight from the loop walks
dicts the step thread is changing. Here a real ``DecodeWorker`` (tiny model, real
NIXL agent) decodes 16 requests while ``stats`` is called in a tight loop; every
engine read made during a step is recorded.
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from decode.worker import DecodeWorker
from engine.config import EngineConfig
from engine.sampling_params import SamplingParams
from messages.codec import pack, unpack
from messages.wire import GenerateRequest, TokenBatch, WorkerStats
from tests.unit.decode_attempts import attempt_items


def _instrument(worker: DecodeWorker, monkeypatch: pytest.MonkeyPatch, steps: list[int] | None = None
                ) -> list[str]:
    """Make each step hold its thread a little longer (as a large model's would, but sleeping: wall
    time without CPU) and record every engine read that happens while a step runs; ``steps`` gets a 1
    a step."""
    engine = worker.engine
    stepping = threading.Event()
    touched: list[str] = []
    real_step = engine.step

    def step() -> Any:
        stepping.set()
        if steps is not None:
            steps.append(1)
        try:
            time.sleep(0.002)
            return real_step()
        finally:
            stepping.clear()

    def watch(owner: Any, name: str) -> None:
        real = getattr(owner, name)

        def read(*args: Any, **kwargs: Any) -> Any:
            if stepping.is_set() and threading.current_thread() is threading.main_thread():
                touched.append(name)
            return real(*args, **kwargs)

        monkeypatch.setattr(owner, name, read)

    monkeypatch.setattr(engine, "step", step)
    watch(engine, "stats")
    watch(engine.kv, "num_stored_tokens")
    watch(engine.kv, "blocks_of")
    return touched


def test_stats_in_a_tight_loop_never_read_the_engine_mid_step(tiny_model_dir: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    config = EngineConfig(num_kv_blocks=128, block_size=16, max_num_seqs=16)
    worker = DecodeWorker("decode-t", str(tiny_model_dir), pack(config))
    steps: list[int] = []
    touched = _instrument(worker, monkeypatch, steps)
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    prompts = [[(7 * i + j) % 250 + 1 for j in range(40)] for i in range(16)]
    requests = [GenerateRequest(request_id=f"r{i}", prompt_token_ids=p, sampling=params)
                for i, p in enumerate(prompts)]

    async def consume(req: GenerateRequest) -> int:
        n = 0
        async for item in attempt_items(worker, req):
            assert isinstance(item, TokenBatch), item
            n += len(item.token_ids)
        return n

    async def main() -> tuple[int, list[BaseException], list[int], WorkerStats]:
        await worker.ready()
        tasks = [asyncio.create_task(consume(r)) for r in requests]
        calls, errors = 0, list[BaseException]()
        while not all(t.done() for t in tasks):
            try:
                unpack(await worker.stats(), WorkerStats)
                calls += 1
            except Exception as exc:  # a dict changing size under the read, for one
                errors.append(exc)
            await asyncio.sleep(0)
        produced = await asyncio.gather(*tasks)
        final = unpack(await worker.stats(), WorkerStats)
        await worker.aengine.stop()
        return calls, errors, produced, final

    calls, errors, produced, final = asyncio.run(main())
    assert produced == [48] * 16
    assert calls >= 20, calls
    assert errors == []
    assert touched == [], f"{len(touched)} engine reads during a step, e.g. {touched[:3]}"
    assert final.kv.used_blocks == 0 and final.requests.running == 0
    # the step clocks (AsyncEngine.clock): every step counted; its 2 ms sleep is wall time, not CPU
    assert final.clock.steps == len(steps) >= 48
    assert final.clock.wall_s - final.clock.cpu_s >= 0.002 * len(steps)
    assert final.clock.cpu_s > 0
    # what the steps computed (engine/step_work.py), in WorkerStats: every step is one kind or the other,
    # and every token is computed once: 16 prompts of 40, then 47 of each request's 48 outputs
    assert final.clock.decode_steps + final.clock.prefill_steps == final.clock.steps
    assert final.clock.prefill_tokens + final.clock.decode_rows == 16 * 40 + 16 * 47
    assert final.clock.decode_wall_s + final.clock.prefill_wall_s == pytest.approx(
        final.clock.wall_s)

"""An abort from outside (the router's, through a worker's ``abort``) ends the request's stream at once.

A worker streams a request's outputs from ``AsyncEngine.stream``; when the router aborts the request
(its client left), the stream must end with the ``abort`` output, or the worker's generator waits for a
next output that never comes until its timeout, and the router's read of it with it (three abandoned
streams of a disconnect storm held their closing for 117 s that way, until their worker was killed).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.sampling_params import SamplingParams


def test_abort_ends_the_stream_with_the_abort_output(tiny_model_dir: Path) -> None:
    engine = LLMEngine(str(tiny_model_dir), EngineConfig(num_kv_blocks=64, block_size=16, max_num_seqs=4))
    aengine = AsyncEngine(engine)
    params = SamplingParams(max_tokens=10_000, temperature=0.0, ignore_eos=True)
    got: list[str | None] = []

    async def main() -> None:
        def add(e: LLMEngine) -> None:
            e.add_request(list(range(1, 9)), params, request_id="r")
            aengine.open_stream("r")

        await aengine.mutate(add)

        async def consume() -> None:
            async for batch in aengine.stream("r", 60.0):
                got.extend(o.finish_reason for o in batch)
                if len(got) == 3:
                    asyncio.get_running_loop().call_soon(lambda: aborts.append(
                        asyncio.ensure_future(aengine.abort("r"))))

        aborts: list[asyncio.Future[object]] = []
        await asyncio.wait_for(consume(), 30)  # well before the stream's own 60 s timeout could end it
        assert await aborts[0] is not None
        assert await aengine.abort("r") is None  # gone: nothing to end twice
        await aengine.stop()

    asyncio.run(main())
    assert got[-1] == "abort" and all(r is None for r in got[:-1])
    assert engine.kv.pool.num_used_blocks == 0

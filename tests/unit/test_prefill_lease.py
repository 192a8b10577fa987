"""A prefill lease ended by the router (``release`` or ``abort`` of the request) ends at once: no lease is
left counted on the worker until its deadline, and none is reported as expired later.

Found by the chaos soak (``bench.chaos``): a client that disconnected after its prompt was prefilled had
its blocks freed by the router's release, but the lease stayed in the KV source until its deadline and
then counted as expired.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from engine.config import EngineConfig
from engine.sampling_params import SamplingParams
from messages.codec import pack, unpack
from messages.wire import ErrorKind, GenerateRequest, PrefillResult, WorkerError, WorkerStats
from prefill.worker import PrefillWorker


def test_release_and_abort_end_the_lease(tiny_model_dir: Path) -> None:
    config = EngineConfig(num_kv_blocks=64, block_size=16)
    worker = PrefillWorker("prefill-t", str(tiny_model_dir), pack(config), lease_seconds=0.3)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

    async def main() -> list[WorkerStats]:
        seen = []
        for i, end in enumerate(("release", "abort")):
            req = GenerateRequest(request_id=f"r{i}", prompt_token_ids=list(range(1, 41)), sampling=params)
            result = unpack(await worker.prefill(pack(req)), PrefillResult)
            assert len(result.handle.block_ids) == 3
            seen.append(unpack(await worker.stats(), WorkerStats))
            await (worker.release(req.request_id) if end == "release" else worker.abort(req.request_id))
            seen.append(unpack(await worker.stats(), WorkerStats))
        await asyncio.sleep(0.6)  # past both deadlines; the poller has run many times
        seen.append(unpack(await worker.stats(), WorkerStats))
        await worker.aengine.stop()
        return seen

    held, released, held2, aborted, later = asyncio.run(main())
    assert (held.leases.held, held2.leases.held) == (1, 1)
    assert held.kv.used_blocks == 3
    for s in (released, aborted, later):
        assert (s.leases.held, s.kv.used_blocks, s.leases.expired) == (0, 0, 0)


def test_abort_after_the_last_step_takes_no_lease(tiny_model_dir: Path) -> None:
    """The router's abort lands after the prompt's last step but before the worker leased its blocks (the
    window in which the worker reads the block ids): the prefill answers ``aborted`` and nothing stays
    held. Found by the chaos soak: such an abort freed the blocks, then the lease was taken anyway and
    stayed until its deadline."""
    config = EngineConfig(num_kv_blocks=64, block_size=16)
    worker = PrefillWorker("prefill-t", str(tiny_model_dir), pack(config), lease_seconds=30.0)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    req = GenerateRequest(request_id="late", prompt_token_ids=list(range(1, 41)), sampling=params)
    real_read = worker.aengine.read
    aborted: list[str] = []

    async def read_after_abort(fn: Any) -> Any:  # the first read after the last step is the block ids'
        if not aborted:
            aborted.append(req.request_id)
            await worker.abort(req.request_id)
        return await real_read(fn)

    async def main() -> tuple[PrefillResult | WorkerError, WorkerStats]:
        await worker.ready()
        worker.aengine.read = read_after_abort  # type: ignore[method-assign]
        answer = unpack(await worker.prefill(pack(req)), PrefillResult | WorkerError)
        worker.aengine.read = real_read  # type: ignore[method-assign]
        stats = unpack(await worker.stats(), WorkerStats)
        await worker.aengine.stop()
        return answer, stats

    answer, stats = asyncio.run(main())
    assert aborted == ["late"]
    assert isinstance(answer, WorkerError) and answer.kind is ErrorKind.ABORTED, answer
    assert (stats.leases.held, stats.kv.used_blocks) == (0, 0)


def test_lease_poller_sleeps_without_leases_and_wakes_for_a_new_one(tiny_model_dir: Path) -> None:
    """No lease held: the poller does not run (it waits for one); a new lease wakes it, and it
    polls until the lease ends, here at its deadline."""
    config = EngineConfig(num_kv_blocks=64, block_size=16)
    worker = PrefillWorker("prefill-t", str(tiny_model_dir), pack(config), lease_seconds=0.3)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    real_poll, polls = worker.source.poll, [0]

    def counting_poll(now: float | None = None) -> tuple[list[str], list[str]]:
        polls[0] += 1
        return real_poll(now)

    worker.source.poll = counting_poll  # type: ignore[method-assign]

    async def main() -> tuple[int, WorkerStats, WorkerStats]:
        await worker.ready()
        await asyncio.sleep(0.3)
        idle_polls = polls[0]
        req = GenerateRequest(request_id="r", prompt_token_ids=list(range(1, 41)), sampling=params)
        unpack(await worker.prefill(pack(req)), PrefillResult)
        held = unpack(await worker.stats(), WorkerStats)
        await asyncio.sleep(0.6)  # past the deadline
        later = unpack(await worker.stats(), WorkerStats)
        await worker.aengine.stop()
        return idle_polls, held, later

    idle_polls, held, later = asyncio.run(main())
    assert idle_polls <= 1  # one pass at start-up, then asleep (every 10 ms would be ~30)
    assert (held.leases.held, held.kv.used_blocks) == (1, 3)
    assert (later.leases.held, later.kv.used_blocks, later.leases.expired) == (0, 0, 1)
    assert polls[0] >= 10  # polled every 10 ms while the lease was held

"""A prefill lease ended by the router (``release`` or ``abort`` of the request) ends at once: no lease is
left counted on the worker until its deadline, and none is reported as expired later.

Found by the chaos soak (``bench.chaos``): a client that disconnected after its prompt was prefilled had
its blocks freed by the router's release, but the lease stayed in the KV source until its deadline and
then counted as expired.

Lease deadlines are read from the worker's ``lease_clock``: a ``FakeClock`` here, moved past a deadline
by the test, so no test sleeps for one.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from engine.config import EngineConfig
from engine.sampling_params import SamplingParams
from messages.codec import pack, unpack
from messages.wire import ErrorKind, GenerateRequest, PrefillResult, WorkerError, WorkerStats
from prefill.worker import PrefillWorker
from tests.fakes import FakeClock
from tests.waiting import until

CONFIG = pack(EngineConfig(num_kv_blocks=64, block_size=16))
PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
IDLE_TURNS = 50  # turns of the event loop in which an idle poller must not poll


def request(rid: str) -> GenerateRequest:
    return GenerateRequest(request_id=rid, prompt_token_ids=list(range(1, 41)), sampling=PARAMS)


async def stats(worker: PrefillWorker) -> WorkerStats:
    return unpack(await worker.stats(), WorkerStats)


def test_release_and_abort_end_the_lease(tiny_model_dir: Path) -> None:
    clock = FakeClock()
    worker = PrefillWorker("prefill-t", str(tiny_model_dir), CONFIG, lease_seconds=0.3, lease_clock=clock)

    async def main() -> list[WorkerStats]:
        seen = []
        for i, end in enumerate(("release", "abort")):
            req = request(f"r{i}")
            result = unpack(await worker.prefill(pack(req)), PrefillResult)
            assert len(result.handle.block_ids) == 3
            assert result.handle.lease_deadline == clock() + 0.3
            seen.append(await stats(worker))
            await (worker.release(req.request_id) if end == "release" else worker.abort(req.request_id))
            seen.append(await stats(worker))
        clock.advance(1.0)  # past both deadlines: a lease still held would expire at the next poll
        await worker._poll_once()
        seen.append(await stats(worker))
        await worker.aengine.stop()
        return seen

    held, released, held2, aborted, later = asyncio.run(main())
    assert (held.leases.held, held2.leases.held) == (1, 1)
    assert held.kv.used_blocks == 3
    for s in (released, aborted, later):
        assert (s.leases.held, s.kv.used_blocks, s.leases.expired) == (0, 0, 0)


def test_abort_after_the_last_step_takes_no_lease(tiny_model_dir: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The router's abort lands after the prompt's last step but before the worker leased its blocks (the
    window in which the worker reads the block ids): the prefill answers ``aborted`` and nothing stays
    held. Found by the chaos soak: such an abort freed the blocks, then the lease was taken anyway and
    stayed until its deadline."""
    worker = PrefillWorker("prefill-t", str(tiny_model_dir), CONFIG, lease_seconds=30.0)
    req = request("late")
    real_read = worker.aengine.read
    aborted: list[str] = []

    async def read_after_abort(fn: Any) -> Any:  # the first read after the last step is the block ids'
        if not aborted:
            aborted.append(req.request_id)
            await worker.abort(req.request_id)
        return await real_read(fn)

    async def main() -> tuple[PrefillResult | WorkerError, WorkerStats]:
        await worker.ready()
        with monkeypatch.context() as patch:
            patch.setattr(worker.aengine, "read", read_after_abort)
            answer = unpack(await worker.prefill(pack(req)), PrefillResult | WorkerError)
        after = await stats(worker)
        await worker.aengine.stop()
        return answer, after

    answer, after = asyncio.run(main())
    assert aborted == ["late"]
    assert isinstance(answer, WorkerError) and answer.kind is ErrorKind.ABORTED, answer
    assert (after.leases.held, after.kv.used_blocks) == (0, 0)


def test_lease_poller_sleeps_without_leases_and_wakes_for_a_new_one(
        tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No lease held: the poller does not run (it waits for one); a new lease wakes it, and it polls until
    the lease ends, here at its deadline. ``poll_interval=0``: while awake it polls at every turn of the
    event loop, so ``IDLE_TURNS`` turns without a poll show it asleep."""
    clock = FakeClock()
    worker = PrefillWorker("prefill-t", str(tiny_model_dir), CONFIG, lease_seconds=0.3, poll_interval=0.0,
                           lease_clock=clock)
    real_poll, polls = worker.source.poll, [0]

    def counting_poll(now: float | None = None) -> tuple[list[str], list[str]]:
        polls[0] += 1
        return real_poll(now)

    monkeypatch.setattr(worker.source, "poll", counting_poll)

    async def turns_without_a_poll() -> bool:
        before = polls[0]
        for _ in range(IDLE_TURNS):
            await asyncio.sleep(0)
        return polls[0] == before

    async def main() -> tuple[int, WorkerStats, WorkerStats]:
        await worker.ready()

        async def started() -> bool:
            return polls[0] >= 1

        await until(started, 30, "the poller's pass at start-up")
        assert await turns_without_a_poll()
        idle_polls = polls[0]
        unpack(await worker.prefill(pack(request("r"))), PrefillResult)
        held = await stats(worker)

        async def polled_ten() -> bool:
            return polls[0] >= idle_polls + 10

        await until(polled_ten, 30, "the poller polling while a lease is held")
        assert (await stats(worker)).leases.held == 1  # its deadline has not come
        clock.advance(0.3)

        async def lease_ended() -> WorkerStats | None:
            s = await stats(worker)
            return s if (s.leases.held, s.kv.used_blocks) == (0, 0) else None

        later = await until(lease_ended, 30, "the lease ending at its deadline")
        assert await turns_without_a_poll()  # asleep again
        await worker.aengine.stop()
        return idle_polls, held, later

    idle_polls, held, later = asyncio.run(main())
    assert idle_polls == 1  # one pass at start-up, then asleep
    assert (held.leases.held, held.kv.used_blocks) == (1, 3)
    assert later.leases.expired == 1

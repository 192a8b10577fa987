"""The router's refresh of worker stats and KV events (``router/worker_table.py``): at its busy interval
while anything moves, at its idle interval once nothing has, and at once again when a request is routed."""

from __future__ import annotations

import asyncio
import time

import pytest

from messages.codec import pack
from messages.wire import RequestStats, WorkerRefresh, WorkerStats
from router import worker_table
from router.handles import DecodeHandle
from router.worker_table import WorkerTable
from tests.fakes import FakeActor

BUSY_S, IDLE_S = 0.01, 60.0


def refresh_reply(running: int = 0) -> bytes:
    return pack(WorkerRefresh(WorkerStats(worker_id="d0", role="decode", pid=7,
                                          requests=RequestStats(running=running))))


async def until(condition: object, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.005)


def test_idle_waits_until_poked_and_a_running_worker_keeps_the_busy_pace(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(worker_table, "ACTIVE_LINGER_S", 0.0)
    actor = FakeActor(refresh=refresh_reply())
    table = WorkerTable([], [DecodeHandle(actor)], call_timeout=1.0)

    async def scenario() -> None:
        table.start(BUSY_S, IDLE_S)
        try:
            await until(lambda: len(actor.calls) >= 1)
            assert not table.active()
            await asyncio.sleep(20 * BUSY_S)  # twenty busy intervals: an idle table refreshes none of them
            assert actor.calls == ["refresh"]
            table.poke()  # a request routed: refreshed now, not a minute from now
            await until(lambda: len(actor.calls) >= 2, timeout=IDLE_S / 4)
            actor.replies["refresh"] = refresh_reply(running=1)
            table.poke()
            await until(lambda: len(actor.calls) >= 10, timeout=IDLE_S / 4)  # running: the busy pace
            assert table.active()
            actor.replies["refresh"] = refresh_reply(running=0)
            await until(lambda: not table.active())
            settled = len(actor.calls)
            await asyncio.sleep(20 * BUSY_S)
            assert len(actor.calls) <= settled + 1  # idle again (at most the refresh under way)
        finally:
            await table.stop()

    asyncio.run(scenario())


def test_load_charged_keeps_the_busy_pace_and_the_linger_outlasts_it() -> None:
    actor = FakeActor(refresh=refresh_reply())
    table = WorkerTable([], [DecodeHandle(actor)], call_timeout=1.0)
    worker = table.decode[0]

    async def scenario() -> None:
        worker.inflight_tokens = 40  # a request sent there (router/load.py charges it, then pokes)
        table.start(BUSY_S, IDLE_S)
        try:
            await until(lambda: len(actor.calls) >= 10, timeout=IDLE_S / 4)
            worker.inflight_tokens = 0
            seen = len(actor.calls)
            # within ACTIVE_LINGER_S of the last activity the pace stays busy (trailing KV events)
            await until(lambda: len(actor.calls) >= seen + 10, timeout=worker_table.ACTIVE_LINGER_S)
        finally:
            await table.stop()

    asyncio.run(scenario())

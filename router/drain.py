"""Graceful drain, the router's side: a worker leaves routing at once, finishes what it holds, and goes.

``Drainer.begin(worker_id)`` runs without awaiting anything, so when it returns no new request or
prefill can be sent to the worker: it is marked draining (``WorkerTable.live`` skips it) and its
blocks leave the prefix index. It refuses (``DrainRefused``, with the HTTP status to answer) an
unknown worker, one already draining, and the last live worker of a role (the cluster would stop
serving).

``Drainer.finish(worker, deadline_s, retire)`` then, all by the deadline:

1. waits until every request this router sent there has left it (``Chooser.in_flight``: a decode
   stream has ended; a prefill's KV has been pulled);
2. asks the worker to drain (``WorkerBase.drain``): it waits until it holds no request, reservation
   or lease, drops its idle prefix cache and answers its final ``WorkerStats``;
3. removes it from the table; decode workers forget a prefill worker's NIXL agent;
4. calls ``retire(worker_id)``: the cluster kills the actor without restart and removes its
   placement group (``cluster.fleet``).

Past the deadline the worker is retired with what it still runs, and those requests continue as
after a worker death: a decode stream migrates with the tokens generated so far (up to
``--migration-limit``), a prefill is retried on another prefill worker. ``DrainReport.moved`` counts
them. Nothing is dropped either way.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import msgspec

from messages.wire import WorkerStats
from router.errors import DrainRefused
from router.handles import WORKER_DIED, DecodeHandle
from router.load import Chooser
from router.worker_table import WorkerState, WorkerTable

log = logging.getLogger(__name__)
Retire = Callable[[str], Awaitable[None]]
POLL_S = 0.02


class DrainReport(msgspec.Struct, frozen=True, kw_only=True):
    """How a drain ended. ``final``: the worker's last stats (``None`` when it was retired at the
    deadline, or died meanwhile); ``moved``: its requests still running at the deadline, moved on."""

    worker_id: str
    role: str
    seconds: float
    moved: int
    final: WorkerStats | None


class Drainer:
    def __init__(self, table: WorkerTable, chooser: Chooser, call_timeout: float) -> None:
        self.table = table
        self.chooser = chooser
        self.call_timeout = call_timeout

    def begin(self, worker_id: str) -> WorkerState:
        """Take the worker out of routing now (no await in here); see the module docstring."""
        worker = self.table.find(worker_id)
        if worker is None or not worker.alive:
            raise DrainRefused(404, f"No live worker {worker_id!r}.", "worker_not_found")
        if worker.draining:
            raise DrainRefused(409, f"Worker {worker_id!r} is draining already.", "already_draining")
        if len(self.table.live(worker.role)) <= 1:
            raise DrainRefused(409, f"Worker {worker_id!r} is the last live {worker.role} worker; add "
                                    f"one before draining it.", "last_worker")
        self.table.start_drain(worker)
        log.info("draining %s: out of routing", worker_id)
        return worker

    async def finish(self, worker: WorkerState, deadline_s: float, retire: Retire) -> DrainReport:
        started = time.monotonic()
        deadline = started + deadline_s
        while self.chooser.in_flight(worker) and worker.alive and time.monotonic() < deadline:
            await asyncio.sleep(POLL_S)
        moved = self.chooser.in_flight(worker)
        final: WorkerStats | None = None
        if not moved and worker.alive:
            try:
                final = await worker.handle.drain(max(0.0, deadline - time.monotonic()))
            except (*WORKER_DIED, TimeoutError) as exc:
                log.warning("%s did not answer its drain: %r", worker.worker_id, exc)
        self.table.remove(worker)
        if worker.role == "prefill" and worker.agent is not None and final is not None:
            name = worker.agent.agent_name
            decodes = [d.handle for d in self.table.decode if d.alive and isinstance(d.handle, DecodeHandle)]
            await asyncio.gather(*[d.disconnect(name, self.call_timeout) for d in decodes],
                                 return_exceptions=True)
        await retire(worker.worker_id)
        report = DrainReport(worker_id=worker.worker_id, role=worker.role,
                             seconds=time.monotonic() - started, moved=moved, final=final)
        log.info("drained %s in %.1f s (%d moved on)", worker.worker_id, report.seconds, moved)
        return report

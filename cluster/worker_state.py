"""What the client knows about each worker: load it has sent there, free KV, and the prefix index.

A background task refreshes every worker's stats and folds its KV events into
the ``PrefixIndex`` every ``interval`` seconds (a missed batch triggers a
snapshot resync). Load is tracked locally as well, so routing reacts to the
requests this client just sent without waiting for the next refresh, and so
are the prompt blocks of requests in flight on each worker (``pending``): a
prefix sent to a worker counts as held there from the moment it is sent,
before the worker has computed and published it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field
from typing import Any

from router.policy import Candidate
from router.prefix_index import PrefixIndex
from transfer.messages import KvEvents, KvSnapshot, WorkerStats, unpack

log = logging.getLogger(__name__)


@dataclass
class WorkerState:
    handle: Any
    role: str
    index: int
    worker_id: str = ""
    alive: bool = True
    inflight_tokens: int = 0
    free_blocks: int = 0
    stats: WorkerStats | None = None
    pending: dict[str, set[int]] = field(default_factory=dict)

    def pending_match(self, hashes: list[int]) -> int:
        """Leading blocks of ``hashes`` that requests already sent here will leave in its cache."""
        best = 0
        for held in self.pending.values():
            n = 0
            for h in hashes:
                if h not in held:
                    break
                n += 1
            best = max(best, n)
        return best


class WorkerTable:
    def __init__(self, prefill: list[Any], decode: list[Any], call_timeout: float) -> None:
        self.prefill = [WorkerState(h, "prefill", i) for i, h in enumerate(prefill)]
        self.decode = [WorkerState(h, "decode", i) for i, h in enumerate(decode)]
        self.call_timeout = call_timeout
        self.index: PrefixIndex | None = None
        self._task: asyncio.Task[None] | None = None

    def all(self) -> list[WorkerState]:
        return self.prefill + self.decode

    def live(self, role: str) -> list[WorkerState]:
        return [w for w in (self.prefill if role == "prefill" else self.decode) if w.alive]

    def find(self, handle: Any) -> WorkerState | None:
        return next((w for w in self.all() if w.handle == handle), None)

    def candidates(self, workers: list[WorkerState], hashes: list[int], block_size: int,
                   num_tokens: int = 0) -> list[Candidate]:
        out = []
        for i, w in enumerate(workers):
            held = max(self.index.match(hashes, w.worker_id) if self.index else 0, w.pending_match(hashes))
            need = max(1, -(-(num_tokens + 1) // block_size) - held)
            out.append(Candidate(i, w.worker_id, held * block_size, w.inflight_tokens, w.free_blocks, need))
        return out

    def mark_dead(self, worker: WorkerState) -> None:
        worker.alive = False
        if self.index is not None:
            self.index.remove_worker(worker.worker_id)

    async def refresh(self) -> None:
        for w in self.all():
            if not w.alive:
                continue
            try:
                reply = await asyncio.wait_for(w.handle.stats.remote(), self.call_timeout)
                stats = unpack(reply, WorkerStats)
                w.stats, w.worker_id, w.free_blocks = stats, stats.worker_id, stats.num_free_kv_blocks
                if self.index is not None:
                    events = unpack(await asyncio.wait_for(w.handle.kv_events.remote(), self.call_timeout),
                                    KvEvents)
                    if not self.index.apply(events):
                        snap = await asyncio.wait_for(w.handle.kv_snapshot.remote(), self.call_timeout)
                        self.index.reset(unpack(snap, KvSnapshot))
            except Exception as exc:  # a dead or slow worker must not stop the refresh of the others
                log.warning("refresh of %s failed: %r", w.worker_id or w.role, exc)

    def start(self, interval: float) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop(interval))

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _loop(self, interval: float) -> None:
        while True:
            await self.refresh()
            await asyncio.sleep(interval)

"""What the client knows about each worker: load it has sent there, free KV, and the prefix index.

A background task refreshes every worker's stats and folds its KV events into
the ``PrefixIndex`` every ``interval`` seconds (a missed batch triggers a
snapshot resync) while anything moves, and every ``idle_interval`` seconds once
nothing has for ``ACTIVE_LINGER_S`` (no load charged, no pending prefix, no
worker running, queuing, reserving, holding a KV block or a lease, no drain or
revival: ``active``); ``poke`` (every routing pick) ends an idle wait at once.
An idle cluster is thus polled once a second instead of ten times, which was
most of an idle server's CPU. Load is tracked locally as well, so routing reacts to the
requests this client just sent without waiting for the next refresh, and so
are the prompt blocks of requests in flight on each worker (``pending``): a
prefix sent to a worker counts as held there from the moment it is sent,
before the worker has computed and published it. A pending entry lives until
its request fails (``settle(ok=False)``), or, once the request has been served
(``settle(ok=True)``), until a KV-events batch drained after that moment has
been folded into the index (the real events replace it); in any case no longer
than its expiry (``pending_ttl`` seconds after it was sent, ``settle_ttl`` after
it was served).

Supervision: a worker found dead (a call raised ``RayActorError`` /
``ActorUnavailableError``, or its stats report a new pid: Ray restarted it
behind our back) leaves routing and the prefix index, and a background task
waits (``revive_timeout``) for Ray to restart it (``max_restarts``): ``on_revive``
asks its ``ready`` and re-registers it (new NIXL agent, connections)
and it serves again. A worker Ray will not restart (``ActorDiedError``) stays out.

Membership changes while serving: ``add`` puts a new worker in (the client has
readied and connected it first); ``start_drain`` takes one out of routing at
once (``live`` skips it; its stats are still refreshed and it is never revived),
and ``remove`` forgets it (see ``router.drain``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

from messages.wire import WorkerStats
from router.handles import DecodeHandle, PrefillHandle
from router.policy import Candidate
from router.prefix_index import PrefixIndex
from transfer.wire import AgentInfo

log = logging.getLogger(__name__)

# how long the refresh stays at its busy interval after the cluster was last seen active: the events of
# blocks freed or cached just after a request ends are folded in at the busy pace
ACTIVE_LINGER_S = 2.0


@dataclass
class Pending:
    """Prompt block hashes a request sent to a worker will leave in its cache."""

    hashes: set[int]
    expires: float  # time.monotonic() deadline
    served_at: float | None = None  # when the request was served there; None while in flight


@dataclass
class WorkerState:
    handle: PrefillHandle | DecodeHandle
    role: str
    index: int
    worker_id: str = ""
    alive: bool = True
    inflight_tokens: int = 0
    free_blocks: int = 0
    stats: WorkerStats | None = None
    pending: dict[str, Pending] = field(default_factory=dict)
    pid: int = 0
    agent: AgentInfo | None = None  # a prefill worker's NIXL agent, from its ``ready``
    restarts: int = 0
    draining: bool = False  # out of routing for good: it finishes what it holds, then leaves

    def add_pending(self, request_id: str, hashes: list[int], ttl: float) -> None:
        self.pending[request_id] = Pending(set(hashes), time.monotonic() + ttl)

    def settle(self, request_id: str, ok: bool, ttl: float) -> None:
        """The request left this worker: served (``ok``: keep its entry until the worker's events
        are folded in, at most ``ttl`` seconds) or failed (drop it now)."""
        entry = self.pending.get(request_id)
        if entry is None:
            return
        if not ok:
            del self.pending[request_id]
            return
        now = time.monotonic()
        entry.served_at = now
        entry.expires = min(entry.expires, now + ttl)

    def drop_published(self, drained_after: float) -> None:
        """Drop entries of requests served before ``drained_after``, when a KV-events batch drained
        then was folded into the index: their blocks are in it now (or were evicted already)."""
        done = [r for r, e in self.pending.items()
                if e.served_at is not None and e.served_at <= drained_after]
        for rid in done:
            del self.pending[rid]

    def pending_match(self, hashes: list[int]) -> tuple[int, int]:
        """Leading blocks of ``hashes`` that requests already sent here will leave in its cache: the
        most over every entry, and the most over requests still in flight (expired entries go)."""
        now = time.monotonic()
        for rid in [r for r, e in self.pending.items() if e.expires <= now]:
            del self.pending[rid]
        best = in_flight = 0
        for entry in self.pending.values():
            n = 0
            for h in hashes:
                if h not in entry.hashes:
                    break
                n += 1
            best = max(best, n)
            if entry.served_at is None:
                in_flight = max(in_flight, n)
        return best, in_flight


class WorkerTable:
    def __init__(self, prefill: list[PrefillHandle], decode: list[DecodeHandle], call_timeout: float) -> None:
        self.prefill = [WorkerState(h, "prefill", i) for i, h in enumerate(prefill)]
        self.decode = [WorkerState(h, "decode", i) for i, h in enumerate(decode)]
        self.call_timeout = call_timeout
        self.index: PrefixIndex | None = None
        self._task: asyncio.Task[None] | None = None
        self.on_revive: Callable[[WorkerState], Awaitable[None]] | None = None
        self.revive_timeout = 600.0
        self._revivals: dict[int, asyncio.Task[None]] = {}
        self._next_index = {"prefill": len(self.prefill), "decode": len(self.decode)}
        self._wake = asyncio.Event()

    def all(self) -> list[WorkerState]:
        return self.prefill + self.decode

    def role(self, role: str) -> list[WorkerState]:
        return self.prefill if role == "prefill" else self.decode

    def live(self, role: str) -> list[WorkerState]:
        """The workers of ``role`` requests may be routed to: alive and not draining."""
        return [w for w in self.role(role) if w.alive and not w.draining]

    def find(self, worker_id: str) -> WorkerState | None:
        return next((w for w in self.all() if w.worker_id == worker_id), None)

    def draining(self) -> list[str]:
        return [w.worker_id for w in self.all() if w.draining]

    def add(self, role: str, handle: PrefillHandle | DecodeHandle, worker_id: str) -> WorkerState:
        """A new worker, ready and connected, joins routing (its index is never reused)."""
        index = self._next_index[role]
        self._next_index[role] += 1
        worker = WorkerState(handle, role, index, worker_id=worker_id)
        self.role(role).append(worker)
        return worker

    def start_drain(self, worker: WorkerState) -> None:
        """Take ``worker`` out of routing now and for good (no revival)."""
        worker.draining = True
        if self.index is not None:
            self.index.remove_worker(worker.worker_id)

    def remove(self, worker: WorkerState) -> None:
        """Forget ``worker`` (idempotent): it leaves the table, the prefix index and supervision; the
        decode requests still open on it get ``ActorUnavailableError`` (they migrate)."""
        workers = self.role(worker.role)
        workers[:] = [w for w in workers if w is not worker]
        worker.alive = False
        if isinstance(worker.handle, DecodeHandle):
            # requests still running there (a drain past its deadline) move on as from a dead worker
            worker.handle.close(ActorUnavailableError(f"{worker.worker_id} left the cluster", None))
        if self.index is not None:
            self.index.remove_worker(worker.worker_id)
        task = self._revivals.pop(id(worker), None)
        if task is not None:
            task.cancel()

    def candidates(self, workers: list[WorkerState], hashes: list[int], block_size: int,
                   num_tokens: int = 0) -> list[Candidate]:
        """One policy row per worker: the prefix it holds or will hold (index or pending), its load,
        and, as ``shared_load_tokens``, the part of that load that computes this prompt's own prefix
        (a request in flight there with the same leading blocks)."""
        out = []
        for i, w in enumerate(workers):
            pending, in_flight = w.pending_match(hashes)
            held = max(self.index.match(hashes, w.worker_id) if self.index else 0, pending)
            need = max(1, -(-(num_tokens + 1) // block_size) - held)
            shared = min(in_flight * block_size, w.inflight_tokens)
            out.append(Candidate(i, w.worker_id, held * block_size, w.inflight_tokens, w.free_blocks, need,
                                 shared))
        return out

    def mark_dead(self, worker: WorkerState) -> None:
        """Take ``worker`` out of routing; wait in the background for Ray to restart it."""
        worker.alive = False
        if self.index is not None:
            self.index.remove_worker(worker.worker_id)
        if self.on_revive is not None and not worker.draining and id(worker) not in self._revivals:
            with contextlib.suppress(RuntimeError):  # no running loop: nothing to supervise with
                task = asyncio.get_running_loop().create_task(self._revive(worker))
                self._revivals[id(worker)] = task
                task.add_done_callback(lambda _: self._revivals.pop(id(worker), None))

    async def _revive(self, worker: WorkerState) -> None:
        name = worker.worker_id or worker.role
        deadline = asyncio.get_running_loop().time() + self.revive_timeout
        while asyncio.get_running_loop().time() < deadline:
            try:
                assert self.on_revive is not None
                await asyncio.wait_for(self.on_revive(worker), self.revive_timeout)
            except ActorDiedError as exc:
                log.warning("%s is dead and will not be restarted: %s", name, exc)
                return
            except (ActorUnavailableError, RayActorError, TimeoutError) as exc:
                log.info("%s not back yet: %r", name, exc)
                await asyncio.sleep(1.0)
                continue
            except Exception as exc:  # e.g. a handshake refused: try again until the deadline
                log.warning("%s restarted but could not rejoin: %r", name, exc)
                await asyncio.sleep(1.0)
                continue
            worker.pid, worker.restarts = 0, worker.restarts + 1
            worker.inflight_tokens, worker.pending = 0, {}
            worker.alive = True
            log.warning("%s restarted and rejoined (restart %d)", name, worker.restarts)
            return
        log.warning("%s did not come back within %.0f s", name, self.revive_timeout)

    async def refresh(self) -> None:
        await asyncio.gather(*[self._refresh_one(w) for w in self.all() if w.alive])

    async def _refresh_one(self, w: WorkerState) -> None:
        try:
            drained_after = time.monotonic()
            got = await w.handle.refresh(self.index is not None, self.call_timeout)
            stats = got.stats
            if w.pid and stats.pid != w.pid:  # Ray restarted it between two refreshes
                log.warning("%s has a new process (pid %d, was %d)", stats.worker_id, stats.pid, w.pid)
                self.mark_dead(w)
                return
            w.stats, w.worker_id, w.pid = stats, stats.worker_id, stats.pid
            w.free_blocks = stats.kv.free_blocks
            if self.index is not None and got.events is not None:
                if not self.index.apply(got.events):
                    self.index.reset(await w.handle.kv_snapshot(self.call_timeout))
                w.drop_published(drained_after)
        except (RayActorError, ActorUnavailableError) as exc:
            log.warning("%s died: %r", w.worker_id or w.role, exc)
            self.mark_dead(w)
        except Exception as exc:  # a slow worker must not stop the refresh of the others
            log.warning("refresh of %s failed: %r", w.worker_id or w.role, exc)

    def active(self) -> bool:
        """Whether anything is moving: load charged or a prefix pending on a worker, a worker that
        (by its last stats) runs, queues or reserves a request or holds a KV block or a lease, a drain
        or a revival under way."""
        if self._revivals:
            return True
        for w in self.all():
            if w.inflight_tokens or w.pending or w.draining:
                return True
            s = w.stats
            if s is not None and (s.requests.running or s.requests.waiting or s.requests.reserved
                                  or s.kv.used_blocks or s.leases.held):
                return True
        return False

    def poke(self) -> None:
        """Something was sent to a worker: end an idle wait now (see the module docstring)."""
        self._wake.set()

    def start(self, interval: float, idle_interval: float | None = None) -> None:
        """Refresh every ``interval`` seconds while ``active``, every ``idle_interval`` (default:
        ``interval``) once it has not been for ``ACTIVE_LINGER_S``."""
        if self._task is None:
            idle = interval if idle_interval is None else max(interval, idle_interval)
            self._task = asyncio.get_running_loop().create_task(self._loop(interval, idle))

    async def stop(self) -> None:
        for task in list(self._revivals.values()):
            task.cancel()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _loop(self, interval: float, idle_interval: float) -> None:
        active_until = 0.0  # the busy pace lasts until then
        while True:
            self._wake.clear()
            await self.refresh()
            now = time.monotonic()
            busy = self.active()
            if busy:
                active_until = now + ACTIVE_LINGER_S
            if busy or now < active_until or idle_interval <= interval:
                await asyncio.sleep(interval)
                continue
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), idle_interval)

"""PDClient: the router's way into the workers (prefill and decode actors), without HTTP; the HTTP app
calls it directly.

One request: ``generate`` picks a decode worker (``router.load.Chooser``) and
runs one ``router.attempt.Attempt`` there (prefill -> pull -> stream, with the
KV failure policy). Migration: when the decode worker dies mid-stream, the
request continues on another decode worker with the prompt plus the tokens
generated so far (at most ``migration_limit`` times); the caller sees one
unbroken stream. The dead attempt's id is aborted and released on every other
worker it touched first, so a prefill lease the dead worker never pulled ends now.

Ready (``is_ready``) once ``start`` has connected every worker and there is at
least one decode worker and at least one prefill worker (or none at all:
colocated mode, where decode runs whole requests).

Restarts: a worker Ray restarts (``max_restarts``) rejoins through
``WorkerTable`` supervision: a restarted prefill worker brings a new NIXL agent,
which every live decode worker connects to; a restarted decode worker connects
to every live prefill worker's agent again. A worker started while serving
joins the same way (``join``); one leaves through ``drain`` (``router.drain``).
``retire`` is how a drained worker's actor goes and ``launch`` how a new one
comes (start it, let it ``join``, answer its id): the cluster sets both
(``cluster.fleet``); without ``launch`` no worker can be added. Every request's
arrival, first token and token batches feed ``window``
(``router.load_window``), which the planner reads.

Every wait has a deadline; a consumer that stops iterating aborts the request on
every worker it touched, and releases prefill leases: ``_abort_on`` is the one
place an abort is sent from.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncGenerator, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

import msgspec

from engine.hashing import seed_for
from messages.wire import ErrorKind, GenerateRequest, KvSnapshot, TokenBatch, WorkerError, WorkerStats
from router.attempt import Attempt
from router.channel import AttemptOutputs
from router.config import ClientConfig
from router.drain import Drainer, DrainReport, Retire
from router.errors import AddRefused, RequestFailed
from router.handles import WORKER_DIED, DecodeHandle, PrefillHandle, WorkerHandle
from router.load import Chooser
from router.load_window import LoadWindow
from router.policy import make_policy
from router.prefix_index import IndexAgreement, PrefixIndex
from router.worker_table import WorkerState, WorkerTable
from transfer.wire import AgentInfo

Launch = Callable[[str], Coroutine[Any, Any, str]]


@dataclass
class _Flight:
    """The request ids one request has gone by (migrations add one each) and the workers it touched."""

    ids: list[str]
    touched: set[WorkerHandle] = field(default_factory=set)


async def _keep(worker_id: str) -> None:
    logging.getLogger(__name__).warning("%s drained; nothing retires its actor here", worker_id)


class PDClient:
    def __init__(self, prefill: list[Any], decode: list[Any], config: ClientConfig | None = None,
                 colocated: bool = False, retire: Retire | None = None) -> None:
        """``prefill`` / ``decode``: the workers' Ray actor handles; ``colocated``: a cluster that runs
        no prefill workers."""
        if colocated and prefill:
            raise ValueError("a colocated cluster has no prefill workers")
        self.config = config or ClientConfig()
        self.colocated = colocated
        self.retire: Retire = retire or _keep
        self.launch: Launch | None = None
        self.table = WorkerTable([PrefillHandle(a) for a in prefill], [DecodeHandle(a) for a in decode],
                                 self.config.call_timeout)
        self.table.on_revive = self._rejoin
        self.chooser = Chooser(self.table, make_policy(self.config.routing), self.config.pending_ttl,
                               self.config.settle_ttl)
        self.attempt = Attempt(self.config, self.table, self.chooser, self._refresh_agent)
        self.drainer = Drainer(self.table, self.chooser, self.config.call_timeout)
        self.window = LoadWindow()
        self._agents: set[str] = set()
        self._started = False
        self._background: set[asyncio.Task[Any]] = set()

    def is_ready(self) -> bool:
        """True once requests can be served (workers loaded and connected)."""
        has_prefill = bool(self.table.prefill) or self.colocated
        return self._started and bool(self.table.decode) and has_prefill

    def routing_decisions(self) -> dict[tuple[str, str, str], int]:
        """Requests routed so far by ``(role, policy, reason)``."""
        return dict(self.chooser.decisions)

    @property
    def prefill(self) -> list[Any]:
        return [w.handle.actor for w in self.table.prefill]

    @property
    def decode(self) -> list[Any]:
        return [w.handle.actor for w in self.table.decode]

    async def start(self, timeout: float = 300.0) -> None:
        """Wait for every worker, handshake decode with prefill agents, start the prefix index; raises
        when they do not within ``timeout``."""
        layouts = await asyncio.gather(*[_decode(w).ready(timeout) for w in self.table.decode])
        agents = await asyncio.gather(*[_prefill(w).ready(timeout) for w in self.table.prefill])
        for worker, agent in zip(self.table.prefill, agents, strict=True):
            worker.agent = agent
            await self._connect(agent, timeout)
        self.chooser.block_size = layouts[0].block_size
        self.table.index = PrefixIndex(layouts[0].block_size, seed_for(layouts[0].model))
        await self.table.refresh()
        self.table.start(self.config.refresh_interval, self.config.idle_refresh_interval)
        self._started = True

    async def close(self) -> None:
        await self.table.stop()
        for worker in self.table.decode:
            _decode(worker).close()

    async def _connect(self, agent: AgentInfo, timeout: float) -> None:
        """Handshake every live decode worker with a prefill agent (a restarted worker brings a new one).

        A decode worker that turns out dead during the handshake is marked dead (it connects to every
        prefill agent when it rejoins): its death is its own, not the prefill worker's, whose join or
        revival goes on. Any other failure (a refused handshake, a timeout) raises."""
        if agent.agent_name not in self._agents:  # draining decode workers too: they may still retry
            live = [d for d in self.table.decode if d.alive]
            results = await asyncio.gather(*[_decode(d).connect(agent, timeout) for d in live],
                                           return_exceptions=True)
            for worker, result in zip(live, results, strict=True):
                if isinstance(result, WORKER_DIED):
                    self.table.mark_dead(worker)
                elif isinstance(result, BaseException):
                    raise result
            self._agents.add(agent.agent_name)

    async def join(self, role: str, actor: Any, timeout: float) -> WorkerState:
        """A new worker joins while serving, as a restarted one rejoins: readied, connected (a prefill
        worker's agent to every live decode worker; a decode worker to every live prefill worker's
        agent), then routed to. Raises what its calls raise (the caller retires the actor)."""
        handle: PrefillHandle | DecodeHandle
        agent = None
        if role == "prefill":
            handle = PrefillHandle(actor)
            agent = await handle.ready(timeout)
            await self._connect(agent, timeout)
        else:
            handle = DecodeHandle(actor)
            layout = await handle.ready(timeout)
            if layout.block_size != self.chooser.block_size:
                raise ValueError(f"the new decode worker's block size {layout.block_size} is not the "
                                 f"cluster's {self.chooser.block_size}")
            agents = [p.agent for p in self.table.live("prefill") if p.agent is not None]
            await asyncio.gather(*[handle.connect(a, timeout) for a in agents])
        stats = await handle.stats(timeout)
        worker = self.table.add(role, handle, stats.worker_id)
        worker.agent, worker.pid, worker.stats = agent, stats.pid, stats
        worker.free_blocks = stats.kv.free_blocks
        return worker

    async def _refresh_agent(self, worker: WorkerState) -> None:
        """After a failed pull: ask the prefill worker for its agent (new if it restarted) and connect it."""
        try:
            worker.agent = await _prefill(worker).ready(self.config.call_timeout)
            await self._connect(worker.agent, self.config.call_timeout)
        except WORKER_DIED:
            self.table.mark_dead(worker)
        except TimeoutError:
            pass  # the next attempt or the refresh loop finds out

    async def _rejoin(self, worker: WorkerState) -> None:
        """Re-register a restarted worker: its NIXL connections start from nothing."""
        timeout = self.config.call_timeout
        if worker.role == "prefill":
            worker.agent = await _prefill(worker).ready(timeout)
            await self._connect(worker.agent, timeout)
            return
        decode = _decode(worker)
        await decode.ready(timeout)
        agents = [p.agent for p in self.table.live("prefill") if p.agent is not None]
        await asyncio.gather(*[decode.connect(a, timeout) for a in agents])

    async def generate(self, req: GenerateRequest) -> AsyncGenerator[TokenBatch, None]:
        """Token batches of ``req`` until the finished one; raises RequestFailed when it cannot be served.
        Closed early (or failed), it aborts the request on every worker it touched."""
        flight = _Flight([req.request_id])
        produced: list[int] = []
        finished = False
        current = req
        self.window.arrived(len(req.prompt_token_ids))
        arrived = first_at = time.monotonic()
        try:
            for attempt in range(self.config.migration_limit + 1):
                live = self.table.live("decode")
                if not live:
                    raise RequestFailed(ErrorKind.UNAVAILABLE, "no live decode worker")
                decode = self.chooser.pick("decode", live, current)
                outputs: AttemptOutputs | None = None
                served = False
                try:
                    outputs = await self.attempt.start(current, decode, flight.touched)
                    while not finished:
                        batch = await outputs.next()
                        if isinstance(batch, WorkerError):
                            raise RequestFailed(batch.kind, batch.message)
                        if produced:
                            self.window.later(len(batch.token_ids))
                        else:
                            first_at = time.monotonic()
                            self.window.first(first_at - arrived, len(req.prompt_token_ids),
                                              batch.cached_tokens, len(batch.token_ids))
                        produced.extend(batch.token_ids)
                        finished = batch.finished
                        served = True
                        yield batch
                    return
                except WORKER_DIED as exc:
                    self.table.mark_dead(decode.worker)
                    # the dead attempt's prefill may have leased blocks the dead worker never pulled
                    self._in_background(self._abort_on(
                        _Flight([current.request_id], flight.touched - {decode.worker.handle})))
                    if attempt == self.config.migration_limit:
                        raise RequestFailed(ErrorKind.UNAVAILABLE, f"decode worker died: {exc}") from exc
                    current = _continuation(req, produced, attempt + 1)
                    flight.ids.append(current.request_id)
                finally:
                    if outputs is not None:
                        outputs.close()
                    self.chooser.release(decode.worker, current.request_id, served)
        finally:
            if finished:
                self.window.done(time.monotonic() - first_at, len(produced))
            else:
                await self._abort_on(flight)

    def _in_background(self, work: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        """Run ``work`` without holding up the caller; the task is kept referenced until it ends."""
        task = asyncio.get_running_loop().create_task(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    async def _abort_on(self, flight: _Flight) -> None:
        """Abort every id of the request on every worker it touched; prefill workers release leases too."""
        timeout = self.config.call_timeout
        calls = [w.abort(r, timeout) for w in flight.touched for r in flight.ids]
        calls += [w.release(r, timeout) for w in flight.touched if isinstance(w, PrefillHandle)
                  for r in flight.ids]
        await asyncio.gather(*calls, return_exceptions=True)

    async def stats(self) -> list[WorkerStats]:
        """Stats of the live workers (a dead or restarting one is left out, within a few seconds)."""
        timeout = min(self.config.call_timeout, 5.0)
        replies = await asyncio.gather(*[w.handle.stats(timeout) for w in self.table.all() if w.alive],
                                       return_exceptions=True)
        return [r for r in replies if isinstance(r, WorkerStats)]

    async def prefix_index_agreement(self) -> list[IndexAgreement]:
        """The prefix index against a snapshot of each live worker's cached blocks (one that does not
        answer within a few seconds is left out)."""
        index = self.table.index
        if index is None:
            return []
        timeout = min(self.config.call_timeout, 5.0)
        replies = await asyncio.gather(*[w.handle.kv_snapshot(timeout) for w in self.table.all() if w.alive],
                                       return_exceptions=True)
        return [index.agreement(r) for r in replies if isinstance(r, KvSnapshot)]

    def drain(self, worker_id: str, deadline_s: float) -> asyncio.Task[DrainReport]:
        """Take a worker out of routing before returning, and drain it in the background
        (``router.drain``); the task's result is its report. Raises ``router.errors.DrainRefused``."""
        worker = self.drainer.begin(worker_id)
        return self._in_background(self.drainer.finish(worker, deadline_s, self.retire))

    def draining(self) -> list[str]:
        """Ids of the workers draining now."""
        return self.table.draining()

    def add_worker(self, role: str) -> asyncio.Task[str]:
        """Start one more ``role`` worker in the background (``launch``); the task's result is its id
        once it serves (it raises what made the start fail, the worker then removed). Raises
        ``router.errors.AddRefused`` before starting."""
        if self.launch is None:
            raise AddRefused(409, "This server cannot start workers.", "not_supported")
        if role == "prefill" and self.colocated:
            raise AddRefused(409, "A colocated server runs no prefill workers.", "colocated")
        return self._in_background(self.launch(role))

    async def check_integrity(self) -> None:
        live = [w.handle for w in self.table.all() if w.alive]
        await asyncio.gather(*[h.check_integrity(self.config.call_timeout) for h in live])


def _prefill(worker: WorkerState) -> PrefillHandle:
    assert isinstance(worker.handle, PrefillHandle)
    return worker.handle


def _decode(worker: WorkerState) -> DecodeHandle:
    assert isinstance(worker.handle, DecodeHandle)
    return worker.handle


def _continuation(req: GenerateRequest, produced: list[int], attempt: int) -> GenerateRequest:
    """The same request resumed: its prompt now ends with the tokens already streamed (a constrained
    request's grammar replays them: ``StructuredOutput.resumed_tokens``)."""
    s = req.sampling
    so = s.structured  # the grammar's state is replayed over the streamed tokens
    if so is not None:
        so = dataclasses.replace(so, resumed_tokens=so.resumed_tokens + len(produced))
    sampling = dataclasses.replace(
        s,
        max_tokens=None if s.max_tokens is None else s.max_tokens - len(produced),
        min_tokens=max(0, s.min_tokens - len(produced)),
        structured=so,
    )
    return msgspec.structs.replace(req, request_id=f"{req.request_id}.m{attempt}",
                                   prompt_token_ids=req.prompt_token_ids + produced, sampling=sampling)

"""``WorkerBase``: the half ``PrefillWorker`` and ``DecodeWorker`` share.

An engine driven by an ``AsyncEngine`` (its step runs in a worker thread), the
KV-event publisher the router's prefix index polls, tracing, and the calls the
router makes of every worker: ``stats``, ``refresh`` (stats and KV events in one
call, the router's periodic read), ``kv_snapshot``,
``abort``, ``check_integrity``, ``kv_digest``, ``drain``.

Thread rule: the engine is touched by one thread at a time. Every read of
engine state here goes through ``AsyncEngine.read`` (between two steps, under
the engine's lock), never straight from the event loop while a step runs.
A role adds its own figures to ``WorkerStats`` by overriding ``role_stats``,
which runs under that same lock.

Tensor parallelism (``tensor_parallel_size`` N > 1): the worker is rank 0 and starts ranks 1..N-1 as
processes of its own (``engine/tp_ranks.py``), each with its NIXL agent (``worker/tp_kv.py``);
``GroupWatch`` ends the whole worker when any rank dies or the group breaks, so Ray restarts it as
one. Why processes of one actor rather than N actors: the group then lives, dies and restarts as one
Ray actor (the failure contract needs nothing more), and its step plans and KV calls never cross
Ray; the ranks share the actor's node and the GPUs of its one placement-group bundle
(``cluster/placement.py``).

Methods called over Ray never raise for a request's sake: they answer a
``messages.wire.WorkerError`` instead.

Drain (``drain``), the worker's half of a graceful exit (the router's half is
``router.drain``): the router calls it once it sends nothing here any more and
its own requests here have ended; the worker waits, by a deadline, until it
holds no request, reservation or lease (``holds``), drops its idle prefix
cache, and answers its final ``WorkerStats`` (``num_used_blocks`` 0 when it
came empty), after which the cluster removes its actor.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time

import msgspec
import torch

from engine.async_engine import AsyncEngine, EngineThread
from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.kv_digest import kv_digest
from engine.kv_events import KvEventPublisher
from engine.kv_sizing import kv_dtype_name
from engine.llm import start_engine
from engine.outputs import RequestMetrics
from engine.sampling_params import SamplingParams
from messages.codec import pack, unpack
from messages.wire import (
    CoreShareStats,
    GrammarStats,
    KvEvents,
    KvSnapshot,
    KvStats,
    KvTierStats,
    RequestStats,
    SpecDecodeStats,
    StepStats,
    WorkerRefresh,
    WorkerStats,
)
from telemetry.histogram import FRACTION_BUCKETS, TOKEN_BUCKETS, Histogram
from telemetry.tracing import TraceConfig, Tracing
from worker.core_gates import step_gate
from worker.tp_kv import EXTENSION
from worker.tp_watch import GroupWatch


class WorkerBase:
    role = "worker"
    tracing: Tracing

    def __init__(self, worker_id: str, model: str | None, config: EngineConfig, torch_threads: int,
                 tracing: bytes | None = None, core_share: str | None = None) -> None:
        torch.set_num_threads(torch_threads)
        self.worker_id = worker_id
        if config.tensor_parallel_size > 1:  # the rank processes take the actor's thread count too
            config = dataclasses.replace(config, num_threads=config.num_threads or torch_threads)
        # built on the thread that will step it: one OpenMP team in this process (engine/async_engine.py)
        thread = EngineThread(torch_threads)
        try:
            self.engine, self.ranks = thread.call(start_engine, model, config, extension=EXTENSION)
        except BaseException:
            thread.close()
            raise
        shares = core_share is not None and config.tensor_parallel_size == 1 and config.device == "cpu"
        self.cores = (step_gate(core_share, worker_id, torch_threads, self.engine.decodes_only_next,
                                self.engine.prompts_thread_invariant(), self.engine.longest_prompt_left)
                      if shares and core_share is not None else None)
        self.aengine = AsyncEngine(self.engine, thread, self.cores)
        self.watch = (GroupWatch(self.ranks, lambda: self.aengine.error, worker_id).start()
                      if self.ranks is not None else None)
        self.events = KvEventPublisher(self.engine.kv)
        self.queue_time = Histogram()
        self.kv_kept = Histogram(FRACTION_BUCKETS)  # --kv-eviction (observe_eviction)
        self.kv_head_budget = Histogram(TOKEN_BUCKETS)
        self.init_tracing(tracing)

    def observe_eviction(self, m: RequestMetrics) -> None:
        """A finished request under ``--kv-eviction``: its kept share of its tokens and (headwise) every
        layer's KV head budget at its last eviction."""
        self.kv_kept.observe(1.0 - m.kv_evicted_tokens / max(1, m.prompt_tokens + m.output_tokens))
        for budget in m.kv_head_budgets:
            self.kv_head_budget.observe(budget)

    def init_tracing(self, config: bytes | None) -> None:
        """Trace to where ``config`` (``TraceConfig`` bytes; ``None``: nowhere) says."""
        self.tracing = Tracing(unpack(config, TraceConfig) if config else None, self.role)

    async def set_tracing(self, config: bytes | None) -> None:
        """Replace the tracing setup (``None``: off), flushing what the old one buffered."""
        self.tracing.shutdown()
        self.init_tracing(config)

    async def flush_traces(self) -> None:
        """Export the spans still buffered (the cluster calls it before the process goes away)."""
        self.tracing.flush()

    def exit_if_group_broken(self) -> None:
        """A tensor-parallel worker whose group broke ends its process here (``GroupWatch``): call it
        before answering an engine failure, so the caller sees a dead worker, not an error."""
        if self.watch is not None:
            self.watch.exit_if_broken()

    async def prepare_grammar(self, params: SamplingParams) -> None:
        """Compile a constrained request's grammar in the engine's grammar thread (cached), before the
        request takes the engine lock, so a slow grammar never holds up other requests' steps; a bad
        grammar raises ``engine.grammar.GrammarError`` (a ValueError)."""
        if params.structured is not None:
            await asyncio.wrap_future(self.engine.grammars.prepare(params.structured))

    async def abort(self, request_id: str) -> None:
        await self.aengine.abort(request_id)

    async def drain(self, timeout: float, poll_interval: float = 0.01) -> bytes:
        """Wait (at most ``timeout`` seconds) until this worker holds nothing, drop its idle prefix
        cache, and answer its final ``WorkerStats``; past the deadline it answers them as they are (the
        caller reads what is still held there)."""
        deadline = time.monotonic() + timeout
        while await self.aengine.read(self.holds) and time.monotonic() < deadline:
            await asyncio.sleep(poll_interval)
        await self.aengine.read(lambda e: e.reset_prefix_cache())
        return await self.stats()

    def holds(self, e: LLMEngine) -> int:
        """Requests, reservations and KV blocks this worker still holds (0: it can leave); engine
        lock held. A role adds what it alone holds (a prefill worker's leases)."""
        return e.num_held()

    async def check_integrity(self) -> None:
        await self.aengine.read(lambda e: e.kv.check_integrity())

    async def kv_digest(self, request_id: str, num_tokens: int) -> str:
        """SHA-256 of the K/V bytes of a request's first ``num_tokens`` tokens (tests compare both sides)."""
        return await self.aengine.read(lambda e: kv_digest(e, request_id, num_tokens))

    async def stats(self) -> bytes:
        """``WorkerStats``, read between two engine steps."""
        return pack(await self.aengine.read(self._stats))

    def _stats(self, e: LLMEngine) -> WorkerStats:
        s, clock = e.stats(), self.aengine.clock
        common = WorkerStats(
            worker_id=self.worker_id, role=self.role, pid=os.getpid(),
            requests=RequestStats(running=s.num_running, waiting=s.num_waiting, reserved=len(e.reserved),
                                  preemptions=s.num_preemptions, queue_time=self.queue_time.data()),
            kv=KvStats(num_blocks=s.num_kv_blocks, free_blocks=s.num_free_kv_blocks,
                       used_blocks=e.num_used_blocks(), cached_blocks=e.num_cached_blocks(),
                       evicted_tokens=s.kv_evicted_tokens,
                       kept_fraction=self.kv_kept.data() if e.eviction is not None else None,
                       head_budget=(self.kv_head_budget.data()
                                    if e.eviction is not None and e.eviction.policy == "headwise" else None),
                       stored_tokens=e.kv.num_stored_tokens(), block_size=e.kv.block_size,
                       dtype=kv_dtype_name(e.config.kv_torch_dtype),
                       tiers=msgspec.convert(s.kv_tiers, list[KvTierStats], from_attributes=True),
                       prefix_queries=s.prefix_queries, prefix_hits=s.prefix_hits),
            grammar=msgspec.convert(e.grammars.stats, GrammarStats, from_attributes=True),
            spec=(msgspec.convert(s.spec, SpecDecodeStats, from_attributes=True) if s.spec is not None
                  else SpecDecodeStats()),
            clock=StepStats(steps=clock.steps, wall_s=clock.wall_s, cpu_s=clock.cpu_s,
                            **dataclasses.asdict(clock.work)),
            cores=self.cores.stats() if self.cores is not None else CoreShareStats(),
        )
        return self.role_stats(common)

    def role_stats(self, common: WorkerStats) -> WorkerStats:
        """The role's own figures added to ``common`` (``msgspec.structs.replace``); engine lock held."""
        return common

    async def refresh(self, events: bool = True) -> bytes:
        """``WorkerRefresh``: the stats and (``events``) the ``KvEvents`` since the last batch, read
        between the same two steps: the router's periodic poll, one call per worker."""
        def read(e: LLMEngine) -> WorkerRefresh:
            if not events:
                return WorkerRefresh(self._stats(e))
            batch = self.events.drain()
            drained = KvEvents(self.worker_id, batch.seq, batch.stored, batch.removed)
            return WorkerRefresh(self._stats(e), drained)
        return pack(await self.aengine.read(read))

    async def kv_snapshot(self) -> bytes:
        seq, hashes = await self.aengine.read(lambda e: self.events.snapshot())
        return pack(KvSnapshot(self.worker_id, seq, hashes))


"""PrefillWorker: runs prompts, samples the first token, and lends the prompt's K/V under a lease.

Contract with the decode side (docs/architecture.md, "One request, hop by hop"):

* ``prefill`` computes only what its prefix cache lacks, samples the first
  token with the request's own sampling parameters, and returns a
  ``PrefillResult`` whose ``KvHandle`` lists the blocks holding the prompt's
  K/V (``ceil(prompt_len / block_size)`` blocks; the first token's K/V is not
  computed here). A sequence compressed while it ran (``--kv-window``,
  ``--kv-eviction``) is handed over as it is: its kept blocks, the tokens it
  dropped and (H2O, head-wise) its blocks' attention mass. Errors come back as a
  ``WorkerError``, never raised across Ray.
  The router does not wait for the result: it hands the call's ``ObjectRef`` to
  the decode worker, which awaits it, pulls the blocks and streams the tokens.
* Those blocks stay owned by the request id (pinned) until the decode side's
  transfer completes ("done" notification), the decode side gives them up
  ("release"), the caller calls ``release``/``abort``, or the lease deadline
  passes. A background task polls the KV source every ``poll_interval``
  seconds while any lease is held (and sleeps while none is: a new lease wakes
  it) and frees them; afterwards the pool holds no block for the request.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import Callable

import msgspec

from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.handoff import HeldKv
from engine.outputs import RequestMetrics
from messages.codec import pack, unpack
from messages.wire import (
    ErrorKind,
    GenerateRequest,
    LeaseStats,
    PrefillResult,
    TokenLogprob,
    WorkerError,
    WorkerStats,
)
from transfer.wire import KvHandle
from worker.base import WorkerBase
from worker.tp_kv import open_source

log = logging.getLogger(__name__)


class PrefillWorker(WorkerBase):
    """Spans (for requests carrying a trace context): ``prefill.queue`` (arrival to first schedule)
    and ``prefill.compute`` (first schedule to first token), children of the caller's span."""

    role = "prefill"

    def __init__(self, worker_id: str, model: str | None, engine_config: bytes,
                 lease_seconds: float = 30.0, torch_threads: int = 1, poll_interval: float = 0.01,
                 request_timeout: float = 300.0, tracing: bytes | None = None,
                 core_share: str | None = None, lease_clock: Callable[[], float] = time.time) -> None:
        # speculation is decoding's business: a prefill worker emits one token per request
        config = dataclasses.replace(unpack(engine_config, EngineConfig), speculative_config=None)
        super().__init__(worker_id, model, config, torch_threads, tracing, core_share)
        # one agent per tensor-parallel rank; leases live on rank 0's (``worker/tp_kv.py``)
        self.source, self.agent = open_source(self.engine, f"{worker_id}-{uuid.uuid4().hex[:8]}")
        self.lease_seconds = lease_seconds
        self.lease_clock = lease_clock  # lease deadlines: wall-clock seconds, as the decode side reads them
        self.poll_interval = poll_interval
        self.request_timeout = request_timeout
        self.leases_expired = 0
        self._poller: asyncio.Task[None] | None = None
        self._leased = asyncio.Event()  # set by each new lease: the poller wakes up
        self._computing: set[str] = set()  # requests in ``_prefill``, not leased yet
        self._dropped: set[str] = set()  # ... of those, the ones released or aborted meanwhile

    async def ready(self) -> bytes:
        """Start background work; returns this worker's NIXL agent info (``transfer.wire.AgentInfo``)."""
        self.aengine.start()
        if self._poller is None:
            self._poller = asyncio.get_running_loop().create_task(self._poll_leases())
        return pack(self.agent)

    async def prefill(self, request: bytes, lease_seconds: float | None = None) -> bytes:
        """``GenerateRequest`` bytes in; ``PrefillResult`` (or ``WorkerError``) bytes out, never a raise.
        ``lease_seconds`` overrides the worker's lease."""
        await self.ready()
        try:
            req = unpack(request, GenerateRequest)
            return pack(await self._prefill(req, lease_seconds))
        except (ValueError, msgspec.ValidationError) as exc:
            return pack(WorkerError(ErrorKind.INVALID, str(exc)))
        except TimeoutError:
            return pack(WorkerError(ErrorKind.TIMEOUT, f"prefill did not finish in {self.request_timeout} s"))
        except RuntimeError as exc:  # the engine loop failed: this worker cannot serve
            self.exit_if_group_broken()  # a broken tensor-parallel group: dies, the prefill is retried
            return pack(WorkerError(ErrorKind.UNAVAILABLE, f"{self.worker_id}: {exc}"))

    async def _prefill(self, req: GenerateRequest,
                       lease_seconds: float | None) -> PrefillResult | WorkerError:
        params = req.sampling
        first = dataclasses.replace(params, max_tokens=1, min_tokens=min(1, params.min_tokens))
        rid = req.request_id

        def add(e: LLMEngine) -> None:
            e.add_request(req.prompt_token_ids, first, request_id=rid, priority=req.priority, hold_kv=True)
            self.aengine.open_stream(rid)

        await self.prepare_grammar(params)
        self._computing.add(rid)
        try:
            await self.aengine.mutate(add)
            last = None
            async for batch in self.aengine.stream(rid, self.request_timeout):
                last = batch[-1]
            assert last is not None and last.finished
            aborted = last.finish_reason == "abort"
            self._trace(req, last.metrics, aborted)
            held = HeldKv([[]]) if aborted else await self.aengine.read(lambda e: e.held_kv(rid))
            if aborted or rid in self._dropped:  # a release or abort came after the last step: no lease
                await self.aengine.mutate(lambda e: e.release_kv(rid))
                return WorkerError(ErrorKind.ABORTED, f"prefill of {rid} was aborted")
        finally:
            self._computing.discard(rid)
            self._dropped.discard(rid)
        deadline = self.lease_clock() + (self.lease_seconds if lease_seconds is None else lease_seconds)
        handle = KvHandle(
            request_id=rid,
            agent_name=self.agent.agent_name,
            block_ids=held.tables[0],
            num_tokens=len(req.prompt_token_ids),
            compat_hash=self.agent.compat_hash,
            lease_deadline=deadline,
            group_block_ids=held.tables[1:],
            dropped_tokens=held.dropped_tokens,
            block_mass=held.block_mass,
        )
        self.source.add_lease(rid, deadline)
        self._leased.set()
        lp = last.logprobs[0] if last.logprobs else None
        return PrefillResult(
            request_id=rid,
            first_token=last.token_ids[0],
            first_logprob=TokenLogprob(lp.token_id, lp.logprob, list(lp.top)) if lp else None,
            handle=handle,
            cached_tokens=last.metrics.cached_prompt_tokens,
        )

    def _trace(self, req: GenerateRequest, m: RequestMetrics, aborted: bool) -> None:
        if m.first_scheduled_time is not None:
            self.queue_time.observe(m.first_scheduled_time - m.arrival_time)
        if not (self.tracing.enabled and req.trace_context):
            return
        attrs = {"pdserve.worker": self.worker_id, "pdserve.request_id": req.request_id}
        scheduled = m.first_scheduled_time or m.finish_time or m.arrival_time
        self.tracing.span_between("prefill.queue", req.trace_context, m.arrival_time, scheduled, attrs)
        done = m.first_token_time or m.finish_time or scheduled
        self.tracing.span_between("prefill.compute", req.trace_context, scheduled, done, {
            **attrs, "gen_ai.usage.input_tokens": m.prompt_tokens,
            "gen_ai.usage.cache_read.input_tokens": m.cached_prompt_tokens,
        }, error="aborted" if aborted else None)

    async def release(self, request_id: str) -> int:
        """Free a request's leased blocks now and end its lease (idempotent); returns how many were freed."""
        self._drop(request_id)
        return await self.aengine.mutate(lambda e: e.release_kv(request_id))

    async def abort(self, request_id: str) -> None:
        """Stop the request and free its blocks; a lease it holds ends with them (not by its deadline)."""
        self._drop(request_id)
        await super().abort(request_id)

    def _drop(self, request_id: str) -> None:
        """End the request's lease, or keep a prefill still computing it from taking one."""
        self.source.end_lease(request_id)
        if request_id in self._computing:
            self._dropped.add(request_id)

    def holds(self, e: LLMEngine) -> int:
        return super().holds(e) + self.source.num_leases()

    def role_stats(self, common: WorkerStats) -> WorkerStats:
        leases = LeaseStats(held=self.source.num_leases(), expired=self.leases_expired)
        return msgspec.structs.replace(common, leases=leases)

    async def _poll_leases(self) -> None:
        while True:
            try:
                await self._poll_once()
            except Exception:  # keep polling: a lease must never outlive its deadline
                log.exception("lease poll failed on %s", self.worker_id)
            self._leased.clear()
            if self.source.num_leases():
                await asyncio.sleep(self.poll_interval)
            else:
                await self._leased.wait()

    async def _poll_once(self) -> None:
        released, expired = self.source.poll(self.lease_clock())
        self.leases_expired += len(expired)
        ended = released + expired
        if ended:
            await self.aengine.mutate(lambda e: [e.release_kv(rid) for rid in ended])

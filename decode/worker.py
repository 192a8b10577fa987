"""DecodeWorker: reserves KV for a prompt, pulls the missing blocks, and decodes with continuous batching.

Contract (DESIGN.md steps 3, 5, 6):

* ``reserve`` admits a request on KV headroom: it holds blocks for the whole
  prompt plus the first token, reusing blocks its prefix cache already holds,
  and reports how many leading blocks those are. No room: a ``WorkerError``
  of kind ``no_kv`` and nothing held.
* ``generate(request_id, prefill_result)`` pulls only the blocks after the
  held ones from the prefill worker named in the handle (one NIXL READ), then
  decodes from the first token and streams ``TokenBatch`` bytes. A failed pull
  yields one ``WorkerError`` of kind ``transfer``, gives the prefill lease
  back, and KEEPS the reservation so the caller can retry with another
  prefill worker or call ``generate(request_id, None)`` to compute the prompt
  here (recompute).
* ``submit`` runs a request entirely here (colocated mode).
* ``abort`` frees everything a request holds, wherever it is.

Spans (for requests carrying a trace context, children of the caller's span):
``decode.queue`` from arrival here (the reservation) to the first schedule
(the prompt's K/V in place), with a ``kv.transfer`` child per pull attempt
(bytes, blocks, descriptors, backend, duration, outcome, attempt), then
``decode`` from the first schedule to the end (output tokens, finish reason).
"""

from __future__ import annotations

import dataclasses
import os
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import msgspec

from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.kv_sizing import kv_dtype_name
from engine.outputs import RequestOutput
from engine.sampling import SamplingParams, TokenLogprobs
from messages.wire import (
    GenerateRequest,
    KvEvents,
    KvSnapshot,
    KvTierStats,
    PrefillResult,
    ReservationInfo,
    TokenBatch,
    TokenLogprob,
    WorkerError,
    WorkerStats,
    pack,
    unpack,
)
from telemetry.histogram import Histogram
from telemetry.tracing import TracedRole, end_span, wall_ns
from transfer.errors import TransferError
from transfer.nixl_sink import KvSink
from transfer.wire import AgentInfo, KvHandle, KvLayout, decode
from worker.base import EngineWorker


@dataclass
class _Trace:
    carrier: dict[str, str]
    queue: Any


def to_batch(outputs: list[RequestOutput], worker_id: str) -> TokenBatch:
    last = outputs[-1]
    tokens = [t for o in outputs for t in o.new_token_ids]
    lps = None
    if last.logprobs is not None:
        lps = [TokenLogprob(lp.token_id, lp.logprob, list(lp.top)) for lp in last.logprobs[-len(tokens):]]
    return TokenBatch(
        request_id=last.request_id, token_ids=tokens, finished=last.finished,
        finish_reason=last.finish_reason, logprobs=lps, prompt_tokens=last.metrics.prompt_tokens,
        cached_tokens=last.metrics.cached_prompt_tokens, worker_id=worker_id,
    )


class DecodeWorker(EngineWorker, TracedRole):
    role = "decode"

    def __init__(self, worker_id: str, model: str | None, engine_config: bytes,
                 transfer_timeout: float = 30.0, torch_threads: int = 1,
                 request_timeout: float = 300.0, tracing: bytes | None = None) -> None:
        super().__init__(worker_id, model, unpack(engine_config, EngineConfig), torch_threads)
        self.init_tracing(tracing)
        self.queue_time = Histogram()
        self.transfer_time = Histogram()
        self._traces: dict[str, _Trace] = {}
        self._kv_ready: dict[str, float] = {}
        runner = self.engine.runner
        self.layout = KvLayout.from_tensor(runner.kv_cache, self.engine.model_config.name, runner.kv_scales)
        self.sink = KvSink(runner.kv_cache, self.layout, scales=runner.kv_scales,
                           agent_name=f"{worker_id}-{uuid.uuid4().hex[:8]}")
        self.transfer_timeout = transfer_timeout
        self.request_timeout = request_timeout
        self.transfer_blocks = self.transfer_bytes = self.transfer_failures = 0
        self.transfer_seconds = 0.0

    async def ready(self) -> bytes:
        self.aengine.start()
        return pack(self.layout)

    async def connect(self, agent_info: bytes) -> None:
        """Handshake with a prefill worker's agent (idempotent); IncompatibleKvError on mismatch."""
        self.sink.connect(decode(agent_info, AgentInfo))

    async def reserve(self, request: bytes) -> bytes:
        req = unpack(request, GenerateRequest)
        self._open_trace(req)
        params = SamplingParams(**msgspec.structs.asdict(req.sampling))

        def take(e: LLMEngine) -> bytes:
            r = e.make_request(req.prompt_token_ids, params, request_id=req.request_id, priority=req.priority)
            res = e.reserve(r)
            if res is None:
                msg = f"{self.worker_id} has no KV room for {r.num_tokens} tokens"
                return pack(WorkerError("no_kv", msg))
            return pack(ReservationInfo(req.request_id, len(res.block_ids), res.num_cached_blocks))

        try:
            return await self.aengine.mutate(take)
        except ValueError as exc:
            return pack(WorkerError("invalid", str(exc)))

    async def generate(self, request_id: str, prefill_result: bytes | None,
                       attempt: int = 1) -> AsyncIterator[bytes]:
        """Stream ``TokenBatch`` bytes (or one ``WorkerError``) for a reserved request; ``attempt``
        numbers the pulls of one request (for its ``kv.transfer`` spans)."""
        last: RequestOutput | None = None
        final = True
        try:
            if prefill_result is None:
                def local(e: LLMEngine) -> None:
                    self.aengine.open_stream(request_id)
                    e.start_local(request_id)

                await self.aengine.mutate(local)
            else:
                result = unpack(prefill_result, PrefillResult)
                handle = decode(result.handle_bytes, KvHandle)
                error = await self._pull(request_id, handle, attempt)
                if error is not None:
                    final = error.kind != "transfer"  # the caller retries or recomputes
                    yield pack(error)
                    return
                lp = result.first_logprob
                first_lp = TokenLogprobs(lp.token_id, lp.logprob, list(lp.top)) if lp else None

                def start(e: LLMEngine) -> RequestOutput:
                    self.aengine.open_stream(request_id)
                    return e.start_prefilled(request_id, result.first_token, first_lp, result.cached_tokens)

                last = await self.aengine.mutate(start)
                yield pack(to_batch([last], self.worker_id))
                if last.finished:
                    return
            async for outputs in self.aengine.stream(request_id, self.request_timeout):
                last = outputs[-1]
                yield pack(to_batch(outputs, self.worker_id))
        finally:
            if final:
                self._finish_trace(request_id, last)

    async def submit(self, request: bytes) -> AsyncIterator[bytes]:
        """Colocated: compute the prompt and decode here, streaming ``TokenBatch`` bytes."""
        req = unpack(request, GenerateRequest)
        params = SamplingParams(**msgspec.structs.asdict(req.sampling))
        self._open_trace(req)
        last: RequestOutput | None = None

        def add(e: LLMEngine) -> None:
            e.add_request(req.prompt_token_ids, params, request_id=req.request_id, priority=req.priority)
            self.aengine.open_stream(req.request_id)

        try:
            await self.aengine.mutate(add)
            async for outputs in self.aengine.stream(req.request_id, self.request_timeout):
                last = outputs[-1]
                yield pack(to_batch(outputs, self.worker_id))
        except ValueError as exc:
            yield pack(WorkerError("invalid", str(exc)))
        finally:
            self._finish_trace(req.request_id, last)

    async def _pull(self, request_id: str, handle: KvHandle, attempt: int = 1) -> WorkerError | None:
        res = self.engine.reserved.get(request_id)
        if res is None:
            self.sink.release(handle)
            return WorkerError("invalid", f"no reservation for {request_id!r}")
        local = self.engine.kv.blocks_of(request_id)
        held = res.metrics.cached_prompt_tokens // self.engine.kv.block_size
        n = len(handle.block_ids)
        t0 = time.monotonic()
        error: WorkerError | None = None
        try:
            stats = await self.sink.read(handle, handle.block_ids[held:n], local[held:n],
                                         self.transfer_timeout)
        except TransferError as exc:
            self.sink.release(handle)
            error, outcome = WorkerError("transfer", f"{exc.outcome}: {exc}"), exc.outcome
        except Exception as exc:  # a dead or unknown peer surfaces from NIXL as a plain error
            error, outcome = WorkerError("transfer", f"error: {exc}"), "error"
        t1 = time.monotonic()
        if error is None:
            self.transfer_blocks += stats.blocks
            self.transfer_bytes += stats.bytes
            self.transfer_seconds += t1 - t0
            self.transfer_time.observe(t1 - t0)
            self._kv_ready[request_id] = t1
            outcome = "ok"
        else:
            self.transfer_failures += 1
        trace = self._traces.get(request_id)
        if trace is not None:
            self.tracing.span_between("kv.transfer", trace.queue or trace.carrier, t0, t1, {
                "pdserve.worker": self.worker_id, "kv.source_agent": handle.agent_name,
                "kv.blocks": stats.blocks if error is None else n - held,
                "kv.bytes": stats.bytes if error is None else 0,
                "kv.descriptors": stats.descriptors if error is None else 0,
                "kv.backend": self.sink.backend, "kv.duration_s": t1 - t0,
                "kv.outcome": outcome, "kv.attempt": attempt,
            }, error=None if error is None else error.message)
        return error

    def _open_trace(self, req: GenerateRequest) -> None:
        if self.tracing.enabled and req.trace_context:
            span = self.tracing.start_span("decode.queue", req.trace_context, attributes={
                "pdserve.worker": self.worker_id, "pdserve.request_id": req.request_id,
                "gen_ai.usage.input_tokens": len(req.prompt_token_ids)})
            self._traces[req.request_id] = _Trace(req.trace_context, span)

    def _finish_trace(self, request_id: str, last: RequestOutput | None) -> None:
        """Observe the queue time; end ``decode.queue`` at the first schedule and emit ``decode``."""
        trace = self._traces.pop(request_id, None)
        ready = self._kv_ready.pop(request_id, 0.0)
        m = last.metrics if last is not None else None
        scheduled = m.first_scheduled_time if m is not None else None
        if m is not None and scheduled is not None:
            self.queue_time.observe(max(0.0, scheduled - max(m.arrival_time, ready)))
        if trace is None:
            return
        now = time.monotonic()
        if last is None or m is None:
            end_span(trace.queue, "ended before decoding")
            return
        end_span(trace.queue, None, wall_ns(scheduled or now))
        finished = last.finished and last.finish_reason != "abort"
        self.tracing.span_between("decode", trace.carrier, scheduled or now, m.finish_time or now, {
            "pdserve.worker": self.worker_id, "gen_ai.usage.output_tokens": m.output_tokens,
            "gen_ai.response.finish_reasons": [last.finish_reason or ""],
            "pdserve.preemptions": m.num_preemptions,
        }, error=None if finished else (last.finish_reason or "not finished"))

    async def abort(self, request_id: str) -> None:
        trace = self._traces.pop(request_id, None)
        self._kv_ready.pop(request_id, None)
        if trace is not None:
            end_span(trace.queue, "aborted")
        await super().abort(request_id)

    async def inject_transfer_failures(self, n: int) -> None:
        self.sink.inject_failures(n)

    async def stats(self) -> bytes:
        s = self.engine.stats()
        pool = self.engine.kv.pool
        return pack(WorkerStats(
            worker_id=self.worker_id, role=self.role, pid=os.getpid(),
            num_running=s.num_running, num_waiting=s.num_waiting,
            num_kv_blocks=s.num_kv_blocks, num_free_kv_blocks=s.num_free_kv_blocks,
            num_used_blocks=pool.num_used_blocks, num_cached_blocks=len(pool.cached),
            num_stored_tokens=self.engine.kv.num_stored_tokens(), block_size=self.engine.kv.block_size,
            num_reserved=len(self.engine.reserved), prefix_queries=s.prefix_queries,
            prefix_hits=s.prefix_hits, num_preemptions=s.num_preemptions,
            transfer_blocks=self.transfer_blocks, transfer_bytes=self.transfer_bytes,
            transfer_seconds=self.transfer_seconds, transfer_failures=self.transfer_failures,
            queue_time=self.queue_time.data(), transfer_time=self.transfer_time.data(),
            kv_cache_dtype=kv_dtype_name(self.engine.config.kv_torch_dtype),
            kv_tiers=[KvTierStats(**dataclasses.asdict(t)) for t in s.kv_tiers],
        ))

    async def kv_events(self) -> bytes:
        """``KvEvents`` since the last call (the router's prefix index polls this)."""
        batch = await self.drain_events()
        return pack(KvEvents(self.worker_id, batch.seq, batch.stored, batch.removed))

    async def kv_snapshot(self) -> bytes:
        return pack(KvSnapshot(self.worker_id, *await self.events_snapshot()))

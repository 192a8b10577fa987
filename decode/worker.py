"""DecodeWorker: reserves KV for a prompt, pulls the missing blocks, and decodes with continuous batching.

Contract (docs/architecture.md, steps 9-14): one call per attempt. ``submit(channel, stream,
request, prefill)`` sends ``TokenBatch`` items until one is ``finished``, or one ``WorkerError`` and
nothing after it, on an output channel (``outputs(channel)``, one Ray stream per router and worker
carrying one ``OutputFrame`` per event-loop turn: every request's items of an engine step in one Ray
item, ``decode/outbox.py``), each tagged ``stream``. What the worker keeps about an attempt meanwhile
is one ``decode/attempt.py:DecodeAttempt``.

* ``prefill`` is a one-element list holding the ``ObjectRef`` of a prefill
  worker's ``prefill`` call (a list, so Ray hands the ref over unresolved), or
  ``None`` to compute the prompt here.
* First the request is admitted on KV headroom: blocks for the whole prompt
  plus the first token are reserved, reusing blocks the prefix cache holds (with
  ``--kv-window`` or ``--kv-eviction``, at most what a compressed sequence holds:
  ``LLMEngine.reserve``). No room: ``WorkerError(no_kv)`` and nothing held.
  Reservation and the prefill run at the same time. A compressed sequence
  (``KvHandle.dropped_tokens``) gets its reservation fitted to its kept blocks
  before the pull.
* With a prefill ref, the worker awaits the ``PrefillResult`` (bounded by
  ``prefill_timeout``), then pulls only the blocks after the ones it already
  holds from the prefill worker named in the handle (one NIXL READ), and
  decodes from the first token. A failed prefill (``prefill``, or
  ``prefill_died`` when its process died) or pull (``transfer``) yields that
  retryable ``WorkerError``, gives the prefill lease back, and KEEPS the
  reservation: the caller calls ``submit`` again with another prefill ref
  (retry) or with ``None`` (recompute here).
* Without a prefill ref the prompt is computed here: in the reservation when
  there is one (recompute), else as a new request (colocated mode).
* ``abort`` frees everything a request holds, wherever it is.
* ``transfer_failure_rate`` (``pdserve serve --inject-transfer-failures``, for testing only) fails
  that fraction of pulls as ``transfer`` errors, drawn from a generator seeded with the engine's
  seed and the worker id (``KvSink.inject_failure_rate``); a restarted worker starts the same draws.

Spans (for requests carrying a trace context, children of the caller's span):
``decode.queue`` from arrival here (the reservation) to the first schedule
(the prompt's K/V in place), with a ``kv.transfer`` child per pull attempt
(bytes, blocks, descriptors, backend, duration, outcome, attempt), then
``decode`` from the first schedule to the end (output tokens, finish reason, and with speculative
decoding the proposed and accepted tokens and their ratio).
"""

from __future__ import annotations

import asyncio
import time
import uuid
import zlib
from collections.abc import AsyncGenerator
from typing import Any

import msgspec
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

from decode.attempt import DecodeAttempt
from decode.outbox import Outbox
from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.outputs import RequestOutput
from engine.sampling import TokenLogprobs
from messages.codec import pack, unpack
from messages.wire import (
    ErrorKind,
    GenerateRequest,
    OutputStats,
    PrefillResult,
    TokenBatch,
    TokenLogprob,
    TransferStats,
    WorkerError,
    WorkerStats,
)
from telemetry.histogram import Histogram
from telemetry.tracing import end_span, wall_ns
from transfer.errors import IncompatibleKvError, TransferError
from transfer.wire import AgentInfo, KvHandle
from worker.base import WorkerBase
from worker.tp_kv import open_sink, rank_layout

PrefillRef = list[Any]  # [ObjectRef of PrefillWorker.prefill]; a list so Ray does not resolve it
_PrefillDied = (ActorDiedError, ActorUnavailableError, RayActorError)


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


class DecodeWorker(WorkerBase):
    role = "decode"

    def __init__(self, worker_id: str, model: str | None, engine_config: bytes,
                 transfer_timeout: float = 30.0, torch_threads: int = 1,
                 request_timeout: float = 300.0, tracing: bytes | None = None,
                 transfer_failure_rate: float = 0.0, core_share: str | None = None) -> None:
        super().__init__(worker_id, model, unpack(engine_config, EngineConfig), torch_threads, tracing,
                         core_share)
        self.transfer_time = Histogram()
        self._attempts: dict[str, DecodeAttempt] = {}  # by request id, from arrival to the last item
        self.layout = rank_layout(self.engine.runner, self.engine.model_config.name)
        # one agent per tensor-parallel rank, each pulling its own KV heads (``worker/tp_kv.py``)
        self.sink = open_sink(self.engine, f"{worker_id}-{uuid.uuid4().hex[:8]}")
        if transfer_failure_rate:
            seed = zlib.crc32(f"{self.engine.config.seed}:{worker_id}".encode())
            self.sink.inject_failure_rate(transfer_failure_rate, seed)
        self.transfer_timeout = transfer_timeout
        self.request_timeout = request_timeout
        self.transfer_blocks = self.transfer_bytes = self.transfer_failures = 0
        self.transfer_seconds = 0.0
        self.outbox = Outbox()

    async def ready(self) -> bytes:
        self.aengine.start()
        return pack(self.layout)

    async def connect(self, agent_info: bytes) -> bytes:
        """Handshake with a prefill worker's agent (idempotent): empty bytes, or a ``WorkerError`` naming
        what differs when the two KV caches cannot exchange blocks."""
        try:
            self.sink.connect(unpack(agent_info, AgentInfo))
        except IncompatibleKvError as exc:
            message = f"{self.worker_id}: incompatible KV ({exc.field}): {exc}"
            return pack(WorkerError(ErrorKind.INVALID, message))
        return b""

    async def disconnect(self, agent_name: str) -> None:
        """Forget a prefill worker's agent: that worker has drained and left (idempotent)."""
        self.sink.disconnect(agent_name)

    async def submit(self, channel: str, stream: int, request: bytes, prefill: PrefillRef | None = None,
                     attempt: int = 1, prefill_timeout: float = 120.0) -> None:
        """Run one attempt at ``request`` (see the module docstring), its items sent on output channel
        ``channel`` tagged ``stream`` (``decode/outbox.py``); returns when it has put its last item.
        ``attempt`` numbers the pulls of one request (for its ``kv.transfer`` spans); the prefill result
        is awaited ``prefill_timeout`` seconds at most."""
        def put(item: TokenBatch | WorkerError) -> None:
            self.outbox.put(channel, stream, item)

        try:
            req = unpack(request, GenerateRequest)
        except msgspec.ValidationError as exc:
            put(WorkerError(ErrorKind.INVALID, str(exc)))
            return
        rid = req.request_id
        last: RequestOutput | None = None
        final = True
        try:
            await self.prepare_grammar(req.sampling)
            if prefill is None:
                await self.aengine.mutate(lambda e: self._start_here(e, req))
            else:
                error, last = await self._prefilled(req, prefill[0], prefill_timeout, attempt)
                if error is not None:
                    final = not error.retryable  # a retry keeps the attempt's reservation
                    put(error)
                    return
                assert last is not None
                put(to_batch([last], self.worker_id))
                if last.finished:
                    return
            async for outputs in self.aengine.stream(rid, self.request_timeout):
                last = outputs[-1]
                put(to_batch(outputs, self.worker_id))
        except ValueError as exc:  # the engine refused the request (e.g. longer than the model allows)
            put(WorkerError(ErrorKind.INVALID, str(exc)))
        except TimeoutError:
            put(WorkerError(ErrorKind.TIMEOUT, f"{rid}: no output for {self.request_timeout} s"))
        except RuntimeError as exc:  # the engine loop failed: this worker cannot serve
            self.exit_if_group_broken()  # a broken tensor-parallel group: dies, the request migrates
            put(WorkerError(ErrorKind.UNAVAILABLE, f"{self.worker_id}: {exc}"))
        finally:
            if final:
                self._end(rid, last)

    async def outputs(self, channel: str) -> AsyncGenerator[bytes, None]:
        """Output channel ``channel``: ``OutputFrame`` bytes, each with every item its attempts put in
        one turn of this worker's event loop, until the caller cancels it (``decode/outbox.py``)."""
        async for frame in self.outbox.frames(channel):
            yield pack(frame)

    async def _prefilled(self, req: GenerateRequest, ref: Any, timeout: float,
                         attempt: int) -> tuple[WorkerError | None, RequestOutput | None]:
        """Reserve, await the prefill, pull its blocks, start decoding: the first output, or the error."""
        error = await self.aengine.mutate(lambda e: self._reserve(e, req))
        if error is not None:
            return error, None
        result = await self._await_prefill(ref, timeout)
        if isinstance(result, WorkerError):
            return result, None
        error = await self._fit_compressed(req.request_id, result.handle)
        if error is not None:
            return error, None
        error = await self._pull(req.request_id, result.handle, attempt)
        if error is not None:
            return error, None
        return None, await self.aengine.mutate(lambda e: self._start_prefilled(e, result))

    def _reserve(self, e: LLMEngine, req: GenerateRequest) -> WorkerError | None:
        """Hold KV for the prompt unless the attempt holds it already (a retry keeps its reservation)."""
        held = self._attempts.get(req.request_id)
        if held is not None and held.reservation is not None:
            return None
        r = e.make_request(req.prompt_token_ids, req.sampling, request_id=req.request_id,
                           priority=req.priority)
        reservation = e.reserve(r)
        if reservation is None:
            return WorkerError(ErrorKind.NO_KV, f"{self.worker_id} has no KV room for {r.num_tokens} tokens")
        slots = tuple(len(g.layers) for g in e.kv.groups)
        self._attempts[req.request_id] = DecodeAttempt(req, reservation, self._queue_span(req),
                                                       group_slots=slots)
        return None

    async def _fit_compressed(self, request_id: str, handle: KvHandle) -> WorkerError | None:
        """A compressed sequence (``KvHandle.dropped_tokens``), more blocks than the reservation holds,
        or a retry's prefill that dropped other blocks than the one the reservation was fitted to: fit
        the reservation to the kept blocks before the pull (``LLMEngine.compress_reservation``). No room
        is ``WorkerError(no_kv)``, with the lease given back."""
        held = self._attempts.get(request_id)
        if held is None or held.reservation is None:
            return None  # _pull answers it
        r = held.reservation
        if handle.dropped_tokens == r.dropped_tokens and len(handle.block_ids) <= len(r.block_ids):
            return None
        kept = handle.num_tokens - handle.dropped_tokens
        reservation = await self.aengine.mutate(
            lambda e: e.compress_reservation(request_id, kept, handle.dropped_tokens))
        held.reservation = reservation
        if reservation is None:
            self.sink.release(handle)
            return WorkerError(ErrorKind.NO_KV, f"{self.worker_id} has no KV room for the {kept} kept "
                                                f"tokens of {request_id}")
        return None

    async def _await_prefill(self, ref: Any, timeout: float) -> PrefillResult | WorkerError:
        try:
            data = await asyncio.wait_for(ref, timeout)
        except _PrefillDied as exc:
            return WorkerError(ErrorKind.PREFILL_DIED, f"prefill worker died: {type(exc).__name__}")
        except TimeoutError:
            return WorkerError(ErrorKind.PREFILL, f"prefill did not answer within {timeout} s")
        except Exception as exc:  # a task error on the prefill side
            return WorkerError(ErrorKind.PREFILL, f"prefill failed: {type(exc).__name__}: {exc}")
        result: PrefillResult | WorkerError = unpack(data, PrefillResult | WorkerError)
        if isinstance(result, WorkerError) and result.kind is not ErrorKind.INVALID:
            return WorkerError(ErrorKind.PREFILL, f"prefill: {result.kind}: {result.message}")
        return result

    def _start_prefilled(self, e: LLMEngine, result: PrefillResult) -> RequestOutput:
        lp = result.first_logprob
        first_lp = TokenLogprobs(lp.token_id, lp.logprob, list(lp.top)) if lp else None
        self.aengine.open_stream(result.request_id)
        return e.start_prefilled(result.request_id, result.first_token, first_lp, result.cached_tokens,
                                 result.handle.block_mass)

    def _start_here(self, e: LLMEngine, req: GenerateRequest) -> None:
        """Compute the prompt here: in its reservation (recompute) or as a new request (colocated)."""
        rid = req.request_id
        self.aengine.open_stream(rid)
        held = self._attempts.get(rid)
        if held is not None and held.reservation is not None:
            e.start_local(rid)
            held.reservation = None
            return
        self._attempts[rid] = DecodeAttempt(req, queue_span=self._queue_span(req))
        e.add_request(req.prompt_token_ids, req.sampling, request_id=rid, priority=req.priority)

    async def _pull(self, request_id: str, handle: KvHandle, attempt: int = 1) -> WorkerError | None:
        """Read the blocks the reservation lacks from the prefill worker, at once: the block ids came with
        the reservation (``DecodeAttempt.pull_blocks``), so the pull waits for no running step (a read of
        the engine here would, and the start after it for the next one: a whole extra decode step before
        every prefilled request's first token). The reservation's blocks are its own until it starts,
        so the pull may write them while a step runs; an abort meanwhile ends the attempt."""
        held = self._attempts.get(request_id)
        if held is None or held.reservation is None:
            self.sink.release(handle)
            return WorkerError(ErrorKind.INVALID, f"no reservation for {request_id!r}")
        remote, local, slots = held.pull_blocks(handle)
        t0 = time.monotonic()
        error: WorkerError | None = None
        try:
            stats = await self.sink.read(handle, remote, local, self.transfer_timeout, slots=slots)
        except TransferError as exc:
            self.sink.release(handle)
            error, outcome = WorkerError(ErrorKind.TRANSFER, f"{exc.outcome}: {exc}"), exc.outcome
        except Exception as exc:  # a dead or unknown peer surfaces from NIXL as a plain error
            error, outcome = WorkerError(ErrorKind.TRANSFER, f"error: {exc}"), "error"
        t1 = time.monotonic()
        if error is None:
            self.transfer_blocks += stats.blocks
            self.transfer_bytes += stats.bytes
            self.transfer_seconds += t1 - t0
            self.transfer_time.observe(t1 - t0)
            held.kv_ready = t1
            outcome = "ok"
        else:
            self.transfer_failures += 1
        if held.queue_span is not None:
            self.tracing.span_between("kv.transfer", held.queue_span, t0, t1, {
                "pdserve.worker": self.worker_id, "kv.source_agent": handle.agent_name,
                "kv.blocks": stats.blocks if error is None else len(remote),
                "kv.bytes": stats.bytes if error is None else 0,
                "kv.descriptors": stats.descriptors if error is None else 0,
                "kv.backend": self.sink.backend, "kv.duration_s": t1 - t0,
                "kv.outcome": outcome, "kv.attempt": attempt,
            }, error=None if error is None else error.message)
        return error

    def _queue_span(self, req: GenerateRequest) -> Any:
        """The attempt's ``decode.queue`` span, from its arrival here (None when it is not traced)."""
        if not (self.tracing.enabled and req.trace_context):
            return None
        return self.tracing.start_span("decode.queue", req.trace_context, attributes={
            "pdserve.worker": self.worker_id, "pdserve.request_id": req.request_id,
            "gen_ai.usage.input_tokens": len(req.prompt_token_ids)})

    def _end(self, request_id: str, last: RequestOutput | None) -> None:
        """The attempt is over: observe its queue time; end ``decode.queue`` at the first schedule and
        emit ``decode``."""
        held = self._attempts.pop(request_id, None)
        m = last.metrics if last is not None else None
        scheduled = m.first_scheduled_time if m is not None else None
        if m is not None and scheduled is not None:
            ready = held.kv_ready if held is not None else 0.0
            self.queue_time.observe(max(0.0, scheduled - max(m.arrival_time, ready)))
        if m is not None and last is not None and last.finished and self.engine.eviction is not None:
            self.observe_eviction(m)
        if held is None or held.queue_span is None:
            return
        now = time.monotonic()
        if last is None or m is None:
            end_span(held.queue_span, "ended before decoding")
            return
        end_span(held.queue_span, None, wall_ns(scheduled or now))
        finished = last.finished and last.finish_reason != "abort"
        carrier = held.request.trace_context
        self.tracing.span_between("decode", carrier, scheduled or now, m.finish_time or now, {
            "pdserve.worker": self.worker_id, "gen_ai.usage.output_tokens": m.output_tokens,
            "gen_ai.response.finish_reasons": [last.finish_reason or ""],
            "pdserve.preemptions": m.num_preemptions,
            "pdserve.kv.evicted_tokens": m.kv_evicted_tokens,
            "pdserve.kv.kept_fraction": 1.0 - m.kv_evicted_tokens / max(1, m.prompt_tokens + m.output_tokens),
            "pdserve.kv.head_budget_min": min(m.kv_head_budgets, default=0),
            "pdserve.kv.head_budget_max": max(m.kv_head_budgets, default=0),
            "pdserve.spec.draft_tokens": m.spec_draft_tokens,
            "pdserve.spec.accepted_tokens": m.spec_accepted_tokens,
            "pdserve.spec.acceptance_rate": (m.spec_accepted_tokens / m.spec_draft_tokens
                                             if m.spec_draft_tokens else 0.0),
        }, error=None if finished else (last.finish_reason or "not finished"))

    async def abort(self, request_id: str) -> None:
        held = self._attempts.pop(request_id, None)
        if held is not None and held.queue_span is not None:
            end_span(held.queue_span, "aborted")
        await super().abort(request_id)

    async def inject_transfer_failures(self, n: int) -> None:
        self.sink.inject_failures(n)

    def role_stats(self, common: WorkerStats) -> WorkerStats:
        transfer = TransferStats(blocks=self.transfer_blocks, bytes=self.transfer_bytes,
                                 seconds=self.transfer_seconds, failures=self.transfer_failures,
                                 time=self.transfer_time.data())
        outputs = OutputStats(frames=self.outbox.frames_sent, items=self.outbox.items_sent)
        return msgspec.structs.replace(common, transfer=transfer, outputs=outputs)

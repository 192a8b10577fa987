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
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import AsyncIterator

import msgspec

from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.outputs import RequestOutput
from engine.sampling import SamplingParams, TokenLogprobs
from engine.worker import EngineWorker
from transfer.errors import TransferError
from transfer.messages import (
    GenerateRequest,
    KvEvents,
    KvSnapshot,
    PrefillResult,
    ReservationInfo,
    TokenBatch,
    TokenLogprob,
    WorkerError,
    WorkerStats,
    pack,
    unpack,
)
from transfer.nixl_sink import KvSink
from transfer.wire import AgentInfo, KvHandle, KvLayout, decode


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


class DecodeWorker(EngineWorker):
    role = "decode"

    def __init__(self, worker_id: str, model: str | None, engine_config: bytes,
                 transfer_timeout: float = 30.0, torch_threads: int = 1,
                 request_timeout: float = 300.0) -> None:
        super().__init__(worker_id, model, unpack(engine_config, EngineConfig), torch_threads)
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

    async def generate(self, request_id: str, prefill_result: bytes | None) -> AsyncIterator[bytes]:
        """Stream ``TokenBatch`` bytes (or one ``WorkerError``) for a reserved request."""
        if prefill_result is None:
            def local(e: LLMEngine) -> None:
                self.aengine.open_stream(request_id)
                e.start_local(request_id)

            await self.aengine.mutate(local)
        else:
            result = unpack(prefill_result, PrefillResult)
            handle = decode(result.handle_bytes, KvHandle)
            error = await self._pull(request_id, handle)
            if error is not None:
                yield pack(error)
                return
            lp = result.first_logprob
            first_lp = TokenLogprobs(lp.token_id, lp.logprob, list(lp.top)) if lp else None

            def start(e: LLMEngine) -> RequestOutput:
                self.aengine.open_stream(request_id)
                return e.start_prefilled(request_id, result.first_token, first_lp, result.cached_tokens)

            first = await self.aengine.mutate(start)
            yield pack(to_batch([first], self.worker_id))
            if first.finished:
                return
        async for outputs in self.aengine.stream(request_id, self.request_timeout):
            yield pack(to_batch(outputs, self.worker_id))

    async def submit(self, request: bytes) -> AsyncIterator[bytes]:
        """Colocated: compute the prompt and decode here, streaming ``TokenBatch`` bytes."""
        req = unpack(request, GenerateRequest)
        params = SamplingParams(**msgspec.structs.asdict(req.sampling))

        def add(e: LLMEngine) -> None:
            e.add_request(req.prompt_token_ids, params, request_id=req.request_id, priority=req.priority)
            self.aengine.open_stream(req.request_id)

        try:
            await self.aengine.mutate(add)
        except ValueError as exc:
            yield pack(WorkerError("invalid", str(exc)))
            return
        async for outputs in self.aengine.stream(req.request_id, self.request_timeout):
            yield pack(to_batch(outputs, self.worker_id))

    async def _pull(self, request_id: str, handle: KvHandle) -> WorkerError | None:
        res = self.engine.reserved.get(request_id)
        if res is None:
            self.sink.release(handle)
            return WorkerError("invalid", f"no reservation for {request_id!r}")
        local = self.engine.kv.blocks_of(request_id)
        held = res.metrics.cached_prompt_tokens // self.engine.kv.block_size
        n = len(handle.block_ids)
        t0 = time.perf_counter()
        try:
            stats = await self.sink.read(handle, handle.block_ids[held:n], local[held:n],
                                         self.transfer_timeout)
        except TransferError as exc:
            self.transfer_failures += 1
            self.sink.release(handle)
            return WorkerError("transfer", f"{exc.outcome}: {exc}")
        except Exception as exc:  # a dead or unknown peer surfaces from NIXL as a plain error
            self.transfer_failures += 1
            return WorkerError("transfer", f"error: {exc}")
        self.transfer_blocks += stats.blocks
        self.transfer_bytes += stats.bytes
        self.transfer_seconds += time.perf_counter() - t0
        return None

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
            num_reserved=len(self.engine.reserved), prefix_queries=s.prefix_queries,
            prefix_hits=s.prefix_hits, num_preemptions=s.num_preemptions,
            transfer_blocks=self.transfer_blocks, transfer_bytes=self.transfer_bytes,
            transfer_seconds=self.transfer_seconds, transfer_failures=self.transfer_failures,
        ))

    async def kv_events(self) -> bytes:
        """``KvEvents`` since the last call (the router's prefix index polls this)."""
        batch = await self.drain_events()
        return pack(KvEvents(self.worker_id, batch.seq, batch.stored, batch.removed))

    async def kv_snapshot(self) -> bytes:
        return pack(KvSnapshot(self.worker_id, *await self.events_snapshot()))

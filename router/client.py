"""PDClient: submit requests to prefill/decode workers without HTTP (the router builds on it).

One request, disaggregated: the routing policy picks a decode worker, which
``reserve``s KV for the prompt; the policy picks a prefill worker, which
``prefill``s (its result names the leased blocks); the decode worker pulls the
blocks it lacks and streams tokens back. The prompt is computed on the decode
worker instead (conditional disaggregation) when there are no prefill workers
(colocated mode), when its part the decode worker lacks is under
``disagg_min_tokens``, or while every prefill worker has more than
``prefill_saturation_tokens`` in flight.

Failure policy (``kv_failure_policy``) when the prefill worker dies, times
out, or the pull fails: ``retry`` prefills again on another prefill worker
(each tried at most once per request; when none is left the prompt is
recomputed on the decode worker), ``recompute`` computes it on the decode
worker, ``fail`` raises ``RequestFailed``.

Migration: when the decode worker dies mid-stream, the request continues on
another decode worker with the prompt plus the tokens generated so far (at
most ``migration_limit`` times); the caller sees one unbroken stream.

Restarts: a worker Ray restarts (``max_restarts``) rejoins through
``WorkerTable`` supervision: a restarted prefill worker brings a new NIXL agent,
which every live decode worker connects to; a restarted decode worker connects
to every live prefill worker's agent again.

Every wait has a deadline; a consumer that stops iterating (or ``abort``)
aborts the request on every worker it touched.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Any

import msgspec
from ray.exceptions import ActorUnavailableError, RayActorError, RayTaskError

from engine.hashing import seed_for
from messages.wire import (
    GenerateRequest,
    PrefillResult,
    RequestFailed,
    ReservationInfo,
    TokenBatch,
    WorkerError,
    WorkerStats,
    pack,
    unpack,
)
from router.config import ClientConfig, KvFailurePolicy
from router.policy import RoutingPolicy, make_policy
from router.prefix_index import PrefixIndex
from router.worker_table import WorkerState, WorkerTable
from transfer.wire import AgentInfo, KvHandle, KvLayout
from transfer.wire import decode as decode_wire

Reply = ReservationInfo | WorkerError
Streamed = TokenBatch | WorkerError
WorkerDied = (RayActorError, ActorUnavailableError)


class PDClient:
    def __init__(self, prefill: list[Any], decode: list[Any], config: ClientConfig | None = None) -> None:
        self.config = config or ClientConfig()
        self.policy: RoutingPolicy = make_policy(self.config.routing)
        self.table = WorkerTable(prefill, decode, self.config.call_timeout)
        self.table.on_revive = self._rejoin
        self.block_size = 16
        self.decisions: dict[tuple[str, str, str], int] = {}
        self._touched: dict[str, set[Any]] = {}
        self._agents: set[str] = set()
        self._charges: dict[tuple[int, str], int] = {}

    @property
    def prefill(self) -> list[Any]:
        return [w.handle for w in self.table.prefill]

    @property
    def decode(self) -> list[Any]:
        return [w.handle for w in self.table.decode]

    async def start(self, timeout: float = 300.0) -> None:
        """Wait for every worker, handshake decode with prefill agents, start the prefix index."""
        layouts = await asyncio.wait_for(asyncio.gather(*[h.ready.remote() for h in self.decode]), timeout)
        infos = await asyncio.wait_for(asyncio.gather(*[h.ready.remote() for h in self.prefill]), timeout)
        for worker, info in zip(self.table.prefill, infos, strict=True):
            worker.info = info
            await self._connect(info, timeout)
        layout = unpack(layouts[0], KvLayout)
        self.block_size = layout.block_size
        self.table.index = PrefixIndex(layout.block_size, seed_for(layout.model))
        await self.table.refresh()
        self.table.start(self.config.refresh_interval)

    async def close(self) -> None:
        await self.table.stop()

    async def _connect(self, info: bytes, timeout: float) -> None:
        """Handshake every live decode worker with a prefill agent (a restarted worker brings a new one)."""
        name = decode_wire(info, AgentInfo).agent_name
        if name not in self._agents:
            live = [d.handle for d in self.table.live("decode")]
            await asyncio.wait_for(asyncio.gather(*[d.connect.remote(info) for d in live]), timeout)
            self._agents.add(name)

    async def _rejoin(self, worker: WorkerState, info: bytes) -> None:
        """Re-register a restarted worker: its NIXL connections start from nothing."""
        if worker.role == "prefill":
            worker.info = info
            await self._connect(info, self.config.call_timeout)
            return
        infos = [p.info for p in self.table.live("prefill") if p.info]
        await asyncio.wait_for(asyncio.gather(*[worker.handle.connect.remote(i) for i in infos]),
                               self.config.call_timeout)

    async def generate(self, req: GenerateRequest) -> AsyncGenerator[TokenBatch, None]:
        """Stream token batches for ``req``; raises RequestFailed when it cannot be served."""
        rid = req.request_id
        self._touched[rid] = set()
        produced: list[int] = []
        finished = False
        current = req
        try:
            for attempt in range(self.config.migration_limit + 1):
                decode = self._pick_decode(current)
                served = False
                try:
                    stream = await self._open(current, decode)
                    async for batch in self._iterate(stream):
                        produced.extend(batch.token_ids)
                        finished = batch.finished
                        served = True
                        yield batch
                    return
                except WorkerDied as exc:
                    self.table.mark_dead(decode)
                    if attempt == self.config.migration_limit:
                        raise RequestFailed("unavailable", f"decode worker died: {exc}") from exc
                    current = _continuation(req, produced, attempt + 1)
                    self._touched[current.request_id] = self._touched[rid]
                finally:
                    self._release_load(decode, current, served)
        finally:
            touched = self._touched.pop(rid, set())
            if current is not req:
                self._touched.pop(current.request_id, None)
            if not finished:
                await self._abort_on(touched, [rid, current.request_id])

    def _pick_decode(self, req: GenerateRequest) -> WorkerState:
        live = self.table.live("decode")
        if not live:
            raise RequestFailed("unavailable", "no live decode worker")
        return self._choose("decode", live, req)

    def _choose(self, role: str, live: list[WorkerState], req: GenerateRequest) -> WorkerState:
        """Ask the policy; charge the worker the work it takes on until ``_release_load``: the
        prompt tokens it lacks (to compute on prefill, to receive or compute on decode) plus, on
        decode, the tokens it will generate."""
        n = len(req.prompt_token_ids)
        hashes = self.table.index.hashes(req.prompt_token_ids) if self.table.index else []
        cands = self.table.candidates(live, hashes, self.block_size, n)
        need = -(-(n + 1) // self.block_size)
        chosen, reason = self.policy.pick(role, cands, n, need)
        self._count(role, reason)
        worker = live[chosen.index]
        output = (req.sampling.max_tokens or 0) if role == "decode" else 0
        charge = max(n - chosen.prefix_tokens, 0) + output
        worker.inflight_tokens += charge
        worker.add_pending(req.request_id, hashes, self.config.pending_ttl)
        self._charges[(id(worker), req.request_id)] = charge
        return worker

    def _release_load(self, worker: WorkerState, req: GenerateRequest, ok: bool) -> None:
        """The request is done with ``worker``: uncharge its load; its pending prefix stays until the
        worker's KV events show it (``ok``: the worker computed or received it) or goes now."""
        charge = self._charges.pop((id(worker), req.request_id), 0)
        worker.inflight_tokens = max(0, worker.inflight_tokens - charge)
        worker.settle(req.request_id, ok, self.config.settle_ttl)

    async def _open(self, req: GenerateRequest, decode: WorkerState) -> Any:
        self._touched[req.request_id].add(decode.handle)
        prefills = self.table.live("prefill")
        if not prefills:
            return decode.handle.submit.options(num_returns="streaming").remote(pack(req))
        res: Reply = unpack(await self._call(decode.handle.reserve.remote(pack(req))), Reply)  # type: ignore[arg-type]
        if isinstance(res, WorkerError):
            raise RequestFailed(res.kind, res.message)
        missing = len(req.prompt_token_ids) - res.num_cached_blocks * self.block_size
        saturated = all(w.inflight_tokens > self.config.prefill_saturation_tokens for w in prefills)
        if missing < self.config.disagg_min_tokens or saturated:
            self._count("local", "short" if not saturated else "prefill_saturated")
            return self._local(req, decode)
        return await self._disaggregated(req, decode, prefills)

    def _local(self, req: GenerateRequest, decode: WorkerState) -> Any:
        return decode.handle.generate.options(num_returns="streaming").remote(req.request_id, None)

    def _count(self, role: str, reason: str) -> None:
        key = (role, self.policy.name, reason)
        self.decisions[key] = self.decisions.get(key, 0) + 1

    async def _disaggregated(self, req: GenerateRequest, decode: WorkerState,
                             prefills: list[WorkerState]) -> Any:
        rid = req.request_id
        policy = self.config.kv_failure_policy
        tried: set[int] = set()
        last_error = ""
        while len(tried) < len(prefills):
            worker = self._choose("prefill", [p for p in prefills if p.index not in tried], req)
            tried.add(worker.index)
            self._touched[rid].add(worker.handle)
            computed = False
            try:
                result = await asyncio.wait_for(worker.handle.prefill.remote(pack(req)),
                                                self.config.prefill_timeout)
                handle = decode_wire(unpack(result, PrefillResult).handle_bytes, KvHandle)
                computed = True
                if handle.agent_name not in self._agents:
                    worker.info = await self._call(worker.handle.ready.remote())
                    await self._connect(worker.info, self.config.call_timeout)
            except (*WorkerDied, RayTaskError, TimeoutError) as exc:
                if isinstance(exc, WorkerDied):
                    self.table.mark_dead(worker)
                last_error = f"prefill: {type(exc).__name__}: {exc}"
            else:
                stream = decode.handle.generate.options(num_returns="streaming").remote(rid, result,
                                                                                         len(tried))
                first = await self._next(stream)
                if isinstance(first, TokenBatch):
                    return _Prepended(first, stream)
                last_error = f"{first.kind}: {first.message}"
                if first.kind != "transfer":
                    raise RequestFailed(first.kind, first.message)
            finally:
                self._release_load(worker, req, computed)
            if policy is not KvFailurePolicy.RETRY:
                break
        if policy is KvFailurePolicy.FAIL:
            raise RequestFailed("transfer", f"request {rid} failed under policy 'fail': {last_error}")
        self._count("local", "recompute")
        return self._local(req, decode)

    async def _next(self, stream: Any) -> Streamed:
        ref = await asyncio.wait_for(stream.__anext__(), self.config.stream_timeout)
        data = await asyncio.wait_for(ref, self.config.stream_timeout)
        return unpack(data, Streamed)  # type: ignore[arg-type]

    async def _iterate(self, stream: Any) -> AsyncIterator[TokenBatch]:
        while True:
            if isinstance(stream, _Prepended):
                item: Streamed = stream.first
                stream = stream.rest
            else:
                try:
                    item = await self._next(stream)
                except StopAsyncIteration:
                    return
            if isinstance(item, WorkerError):
                raise RequestFailed(item.kind, item.message)
            yield item
            if item.finished:
                return

    async def _call(self, ref: Any) -> Any:
        return await asyncio.wait_for(ref, self.config.call_timeout)

    async def abort(self, request_id: str) -> None:
        await self._abort_on(self._touched.get(request_id, set()), [request_id])

    async def _abort_on(self, workers: set[Any], request_ids: list[str]) -> None:
        prefill = set(self.prefill)
        calls = [w.abort.remote(r) for w in workers for r in set(request_ids)]
        calls += [w.release.remote(r) for w in workers if w in prefill for r in set(request_ids)]
        await asyncio.gather(*[asyncio.wait_for(c, self.config.call_timeout) for c in calls],
                             return_exceptions=True)

    async def stats(self) -> list[WorkerStats]:
        """Stats of the live workers (a dead or restarting one is left out, within a few seconds)."""
        timeout = min(self.config.call_timeout, 5.0)
        replies = await asyncio.gather(
            *[asyncio.wait_for(w.handle.stats.remote(), timeout) for w in self.table.all() if w.alive],
            return_exceptions=True)
        return [unpack(r, WorkerStats) for r in replies if isinstance(r, bytes)]

    async def check_integrity(self) -> None:
        live = [w.handle for w in self.table.all() if w.alive]
        await asyncio.gather(*[self._call(h.check_integrity.remote()) for h in live])


@dataclass
class _Prepended:
    first: TokenBatch
    rest: Any


def _continuation(req: GenerateRequest, produced: list[int], attempt: int) -> GenerateRequest:
    """The same request resumed: its prompt now ends with the tokens already streamed."""
    s = req.sampling
    sampling = msgspec.structs.replace(
        s,
        max_tokens=None if s.max_tokens is None else s.max_tokens - len(produced),
        min_tokens=max(0, s.min_tokens - len(produced)),
    )
    return msgspec.structs.replace(req, request_id=f"{req.request_id}.m{attempt}",
                                   prompt_token_ids=req.prompt_token_ids + produced, sampling=sampling)

"""PDClient: submit requests to prefill/decode workers without HTTP (the router builds on it).

One request, disaggregated: pick a decode worker and ``reserve`` there; pick a
prefill worker and ``prefill`` (its result names the leased blocks); the decode
worker pulls the blocks it lacks and streams tokens back. With no prefill
workers (colocated mode) the decode worker does everything (``submit``).

Failure policy (``--kv-failure-policy``) when the prefill worker dies, times
out, or the pull fails:

* ``retry``: prefill again on another prefill worker (each worker is tried at
  most once per request; when none is left, the prompt is recomputed on the
  decode worker so the request still completes);
* ``recompute``: compute the prompt on the decode worker;
* ``fail``: raise ``RequestFailed``.

Every wait has a deadline; a consumer that stops iterating (or ``abort``)
aborts the request on every worker it touched.
"""

from __future__ import annotations

import asyncio
import enum
import itertools
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import RayActorError, RayTaskError

from transfer.messages import (
    GenerateRequest,
    PrefillResult,
    ReservationInfo,
    TokenBatch,
    WorkerError,
    WorkerStats,
    pack,
    unpack,
)

Reply = ReservationInfo | WorkerError
Streamed = TokenBatch | WorkerError


class KvFailurePolicy(enum.StrEnum):
    RETRY = "retry"
    RECOMPUTE = "recompute"
    FAIL = "fail"


class RequestFailed(RuntimeError):
    """A request could not be served; ``kind`` says why (no_kv, invalid, transfer, prefill, timeout)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True)
class ClientConfig:
    kv_failure_policy: KvFailurePolicy = KvFailurePolicy.RETRY
    prefill_timeout: float = 120.0
    call_timeout: float = 30.0
    stream_timeout: float = 300.0


class PDClient:
    def __init__(self, prefill: list[Any], decode: list[Any], config: ClientConfig | None = None) -> None:
        self.prefill = list(prefill)
        self.decode = list(decode)
        self.config = config or ClientConfig()
        self._rr_prefill = itertools.count()
        self._rr_decode = itertools.count()
        self._touched: dict[str, set[Any]] = {}

    async def start(self, timeout: float = 300.0) -> None:
        """Wait until every worker has loaded, then connect each decode worker to each prefill agent."""
        infos = await asyncio.wait_for(asyncio.gather(*[w.ready.remote() for w in self.prefill]), timeout)
        await asyncio.wait_for(asyncio.gather(*[w.ready.remote() for w in self.decode]), timeout)
        await asyncio.wait_for(
            asyncio.gather(*[d.connect.remote(info) for d in self.decode for info in infos]), timeout)

    async def generate(self, req: GenerateRequest) -> AsyncIterator[TokenBatch]:
        """Stream token batches for ``req``; raises RequestFailed when it cannot be served."""
        rid = req.request_id
        decode = self.decode[next(self._rr_decode) % len(self.decode)]
        self._touched[rid] = {decode}
        finished = False
        try:
            if not self.prefill:
                stream = decode.submit.options(num_returns="streaming").remote(pack(req))
            else:
                stream = await self._disaggregated(req, decode)
            async for batch in self._iterate(stream):
                finished = batch.finished
                yield batch
        finally:
            touched = self._touched.pop(rid, set())
            if not finished:
                await self._abort_on(touched, rid)

    async def _disaggregated(self, req: GenerateRequest, decode: Any) -> Any:
        rid = req.request_id
        reply = await self._call(decode.reserve.remote(pack(req)))
        res = unpack(reply, Reply)  # type: ignore[arg-type]
        if isinstance(res, WorkerError):
            raise RequestFailed(res.kind, res.message)
        start = next(self._rr_prefill)
        order = [self.prefill[(start + i) % len(self.prefill)] for i in range(len(self.prefill))]
        policy = self.config.kv_failure_policy
        last_error = ""
        for prefill in order:
            self._touched[rid].add(prefill)
            try:
                ref = prefill.prefill.remote(pack(req))
                result = await asyncio.wait_for(ref, self.config.prefill_timeout)
                unpack(result, PrefillResult)
            except (RayActorError, RayTaskError, TimeoutError) as exc:
                last_error = f"prefill: {type(exc).__name__}: {exc}"
            else:
                stream = decode.generate.options(num_returns="streaming").remote(rid, result)
                first = await self._next(stream)
                if isinstance(first, TokenBatch):
                    return _prepend(first, stream)
                last_error = f"{first.kind}: {first.message}"
                if first.kind != "transfer":
                    raise RequestFailed(first.kind, first.message)
            if policy is not KvFailurePolicy.RETRY:
                break
        if policy is KvFailurePolicy.FAIL:
            raise RequestFailed("transfer", f"request {rid} failed under policy 'fail': {last_error}")
        return decode.generate.options(num_returns="streaming").remote(rid, None)

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
        await self._abort_on(self._touched.get(request_id, set()), request_id)

    async def _abort_on(self, workers: set[Any], request_id: str) -> None:
        calls = [w.abort.remote(request_id) for w in workers]
        await asyncio.gather(*[asyncio.wait_for(c, self.config.call_timeout) for c in calls],
                             return_exceptions=True)
        calls = [w.release.remote(request_id) for w in workers if w in self.prefill]
        await asyncio.gather(*[asyncio.wait_for(c, self.config.call_timeout) for c in calls],
                             return_exceptions=True)

    async def stats(self) -> list[WorkerStats]:
        replies = await asyncio.gather(*[self._call(w.stats.remote()) for w in self.prefill + self.decode],
                                       return_exceptions=True)
        return [unpack(r, WorkerStats) for r in replies if isinstance(r, bytes)]

    async def check_integrity(self) -> None:
        await asyncio.gather(*[self._call(w.check_integrity.remote()) for w in self.prefill + self.decode])


@dataclass
class _Prepended:
    first: TokenBatch
    rest: Any


def _prepend(first: TokenBatch, stream: Any) -> _Prepended:
    return _Prepended(first, stream)


def shutdown_actors(actors: list[Any]) -> None:
    for actor in actors:
        try:
            ray.kill(actor)
        except Exception:  # already dead
            pass

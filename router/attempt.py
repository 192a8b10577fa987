"""One attempt at a request on one decode worker: prefill -> pull -> stream, with the KV failure policy.

The prompt is computed on the decode worker itself (conditional
disaggregation) when there are no prefill workers (colocated mode), when the
part the decode worker lacks (by the router's prefix index) is under
``disagg_min_tokens``, or while every prefill worker has more than
``prefill_saturation_tokens`` in flight. Otherwise a prefill worker is picked
and started, and its result's ``ObjectRef`` goes straight into the decode
worker's ``submit`` call: one round trip from the router to the first token.

Failure policy (``kv_failure_policy``), when the stream's first item is a
retryable ``WorkerError`` (the prefill failed, its worker died, or the pull
failed; the decode worker keeps the reservation): ``retry`` prefills again on
another prefill worker (each tried at most once per attempt; when none is left
the prompt is recomputed on the decode worker), ``recompute`` computes it on
the decode worker, ``fail`` raises ``RequestFailed``. A dead prefill worker is
taken out of routing; after a failed pull the prefill worker's NIXL agent is
(re)connected, since a restarted worker brings a new one.

``Attempt.start`` answers the attempt's ``AttemptOutputs`` (``router.channel``), which the caller
reads and closes: a disaggregated attempt's first item has been looked at already (a retryable error
is acted on here, anything else is read again from ``next``). A dead decode worker surfaces as Ray's
error (``router.handles.WORKER_DIED``) for the caller to migrate; a ``WorkerError`` that is not
retried becomes ``RequestFailed``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from messages.wire import ErrorKind, GenerateRequest, TokenBatch, WorkerError
from router.channel import AttemptOutputs
from router.config import ClientConfig, KvFailurePolicy
from router.errors import RequestFailed
from router.handles import DecodeHandle, PrefillHandle
from router.load import Choice, Chooser
from router.worker_table import WorkerState, WorkerTable

Reconnect = Callable[[WorkerState], Awaitable[None]]


class Attempt:
    def __init__(self, config: ClientConfig, table: WorkerTable, chooser: Chooser,
                 reconnect: Reconnect) -> None:
        self.config = config
        self.table = table
        self.chooser = chooser
        self.reconnect = reconnect

    async def start(self, req: GenerateRequest, decode: Choice, touched: set[Any]) -> AttemptOutputs:
        """Start ``req`` on ``decode``; ``touched`` collects every worker handle it used."""
        handle = decode.worker.handle
        assert isinstance(handle, DecodeHandle)
        touched.add(handle)
        prefills = self.table.live("prefill")
        if prefills:
            missing = len(req.prompt_token_ids) - decode.prefix_tokens
            saturated = all(w.inflight_tokens > self.config.prefill_saturation_tokens for w in prefills)
            if missing >= self.config.disagg_min_tokens and not saturated:
                return await self._disaggregated(req, handle, prefills, touched)
            self.chooser.count("local", "prefill_saturated" if saturated else "short")
        return handle.submit(req, None, 1, self.config.prefill_timeout, self.config.stream_timeout)

    async def _disaggregated(self, req: GenerateRequest, decode: DecodeHandle, prefills: list[WorkerState],
                             touched: set[Any]) -> AttemptOutputs:
        policy = self.config.kv_failure_policy
        tried: set[int] = set()
        last_error = ""
        while True:  # a retry skips workers tried, dead or draining since the attempt began
            options = [p for p in prefills if p.index not in tried and p.alive and not p.draining]
            if not options:
                break
            worker = self.chooser.pick("prefill", options, req).worker
            tried.add(worker.index)
            prefill = worker.handle
            assert isinstance(prefill, PrefillHandle)
            touched.add(prefill)
            outputs = decode.submit(req, prefill.prefill(req), len(tried), self.config.prefill_timeout,
                                    self.config.stream_timeout)
            first = None
            try:
                first = await outputs.next()
            except BaseException:
                outputs.close()
                raise
            finally:
                self.chooser.release(worker, req.request_id, isinstance(first, TokenBatch))
            if not isinstance(first, WorkerError):
                outputs.unread(first)
                return outputs
            outputs.close()
            if not first.retryable:
                raise RequestFailed(first.kind, first.message)
            last_error = f"{first.kind}: {first.message}"
            if first.kind is ErrorKind.PREFILL_DIED:
                self.table.mark_dead(worker)
            elif first.kind is ErrorKind.TRANSFER:
                await self.reconnect(worker)
            if policy is not KvFailurePolicy.RETRY:
                break
        if policy is KvFailurePolicy.FAIL:
            raise RequestFailed(ErrorKind.TRANSFER,
                                f"request {req.request_id} failed under policy 'fail': {last_error}")
        self.chooser.count("local", "recompute")
        return decode.submit(req, None, len(tried) + 1, self.config.prefill_timeout,
                             self.config.stream_timeout)

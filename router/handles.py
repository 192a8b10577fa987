"""Typed handles over the worker actors: every call the router makes into a worker, checked by mypy.

Each method packs its arguments with ``messages.codec`` and unpacks the answer
into its named type, so the wire format is decided here and in the worker
method it calls, nowhere else. Waits are bounded by the caller's deadline
(``timeout``); a dead actor surfaces as Ray's ``RayActorError`` /
``ActorUnavailableError`` (``WORKER_DIED``), which the worker table acts on.

``PrefillHandle.prefill`` returns the call's ``ObjectRef`` without waiting: the
router hands it to ``DecodeHandle.submit``, and the decode worker awaits it,
so a disaggregated request costs the router one round trip before its first
token (reservation and prefill run at the same time).
"""

from __future__ import annotations

import asyncio
from typing import Any

from ray.exceptions import ActorUnavailableError, RayActorError

from messages.codec import pack, unpack
from messages.wire import GenerateRequest, KvSnapshot, WorkerError, WorkerRefresh, WorkerStats
from router.channel import AttemptOutputs, OutputChannel
from router.errors import RequestFailed
from transfer.wire import AgentInfo, KvLayout

WORKER_DIED = (RayActorError, ActorUnavailableError)
DRAIN_REPLY_S = 10.0


class WorkerHandle:
    """The calls both roles answer (``worker.base.WorkerBase``)."""

    def __init__(self, actor: Any) -> None:
        self.actor = actor

    def __eq__(self, other: object) -> bool:
        return isinstance(other, WorkerHandle) and other.actor == self.actor

    def __hash__(self) -> int:
        return hash(self.actor)

    async def stats(self, timeout: float) -> WorkerStats:
        return unpack(await asyncio.wait_for(self.actor.stats.remote(), timeout), WorkerStats)

    async def refresh(self, events: bool, timeout: float) -> WorkerRefresh:
        """Stats and (``events``) the KV events since the last batch, in one call."""
        return unpack(await asyncio.wait_for(self.actor.refresh.remote(events), timeout), WorkerRefresh)

    async def kv_snapshot(self, timeout: float) -> KvSnapshot:
        return unpack(await asyncio.wait_for(self.actor.kv_snapshot.remote(), timeout), KvSnapshot)

    async def abort(self, request_id: str, timeout: float) -> None:
        await asyncio.wait_for(self.actor.abort.remote(request_id), timeout)

    async def check_integrity(self, timeout: float) -> None:
        await asyncio.wait_for(self.actor.check_integrity.remote(), timeout)

    async def drain(self, timeout: float) -> WorkerStats:
        """The worker's final stats once it holds nothing (``WorkerBase.drain``), waiting ``timeout``
        seconds at most there (and a little longer here, for the answer to come back)."""
        reply = await asyncio.wait_for(self.actor.drain.remote(timeout), timeout + DRAIN_REPLY_S)
        return unpack(reply, WorkerStats)


class PrefillHandle(WorkerHandle):
    async def ready(self, timeout: float) -> AgentInfo:
        return unpack(await asyncio.wait_for(self.actor.ready.remote(), timeout), AgentInfo)

    def prefill(self, req: GenerateRequest) -> Any:
        """Start the prefill; the ``ObjectRef`` of its ``PrefillResult | WorkerError`` bytes."""
        return self.actor.prefill.remote(pack(req))

    async def release(self, request_id: str, timeout: float) -> None:
        await asyncio.wait_for(self.actor.release.remote(request_id), timeout)


class DecodeHandle(WorkerHandle):
    def __init__(self, actor: Any) -> None:
        super().__init__(actor)
        self.channel = OutputChannel(actor)

    async def ready(self, timeout: float) -> KvLayout:
        return unpack(await asyncio.wait_for(self.actor.ready.remote(), timeout), KvLayout)

    async def connect(self, agent: AgentInfo, timeout: float) -> None:
        """Raises ``RequestFailed(invalid)`` when the decode worker refuses the agent (incompatible KV)."""
        reply = await asyncio.wait_for(self.actor.connect.remote(pack(agent)), timeout)
        if reply:
            error = unpack(reply, WorkerError)
            raise RequestFailed(error.kind, error.message)

    async def disconnect(self, agent_name: str, timeout: float) -> None:
        await asyncio.wait_for(self.actor.disconnect.remote(agent_name), timeout)

    def submit(self, req: GenerateRequest, prefill_ref: Any | None, attempt: int, prefill_timeout: float,
               item_timeout: float) -> AttemptOutputs:
        """Start one attempt at ``req`` (``DecodeWorker.submit``); its items (token batches up to the
        finished one, or one ``WorkerError``) come on the worker's output channel (``router.channel``).
        The decode worker waits ``prefill_timeout`` seconds at most for ``prefill_ref``; each item must
        arrive within ``item_timeout`` seconds (TimeoutError otherwise)."""
        refs = None if prefill_ref is None else [prefill_ref]
        outputs = self.channel.open(item_timeout)
        try:
            outputs.watch(self.actor.submit.remote(self.channel.name, outputs.number, pack(req), refs,
                                                   attempt, prefill_timeout))
        except BaseException:
            outputs.close()
            raise
        return outputs

    def close(self, error: BaseException | None = None) -> None:
        """Close the output channel; its open attempts get ``error`` (``OutputChannel.close``)."""
        self.channel.close(error)


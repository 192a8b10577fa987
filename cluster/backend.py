"""``ClusterBackend``: the router's ``Backend`` over a ``PDClient`` and its Ray workers."""

from __future__ import annotations

from collections.abc import AsyncIterator

from cluster.client import PDClient
from transfer.messages import GenerateRequest, TokenBatch, WorkerStats


class ClusterBackend:
    """Ready once ``start`` has connected every worker and there is at least one decode worker and
    at least one prefill worker (or none at all: colocated mode, where decode runs whole requests)."""

    def __init__(self, client: PDClient, model_name: str, colocated: bool = False) -> None:
        if colocated and client.prefill:
            raise ValueError("a colocated backend has no prefill workers")
        self.client = client
        self.model_name = model_name
        self.colocated = colocated
        self._started = False

    async def start(self, timeout: float = 300.0) -> None:
        """Wait for the workers to load and connect; raises when they do not within ``timeout``."""
        await self.client.start(timeout)
        self._started = True

    def is_ready(self) -> bool:
        has_prefill = len(self.client.prefill) >= 1 or self.colocated
        return self._started and len(self.client.decode) >= 1 and has_prefill

    def generate(self, req: GenerateRequest) -> AsyncIterator[TokenBatch]:
        return self.client.generate(req)

    async def abort(self, request_id: str) -> None:
        await self.client.abort(request_id)

    async def stats(self) -> list[WorkerStats]:
        return await self.client.stats()

    def routing_decisions(self) -> dict[tuple[str, str, str], int]:
        return dict(self.client.decisions)

"""What the router needs from the serving cluster; the HTTP layer sees nothing else."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Protocol

from messages.wire import GenerateRequest, TokenBatch, WorkerStats

if TYPE_CHECKING:
    from router.client import PDClient
    from router.prefix_index import IndexAgreement


class Backend(Protocol):
    """A source of token streams.

    ``generate`` yields ``TokenBatch`` items until one has ``finished`` set and
    raises ``router.errors.RequestFailed`` when the request cannot be served.
    Closing the iterator early (``aclose``) aborts the request wherever it runs.
    """

    model_name: str

    def is_ready(self) -> bool:
        """True once requests can be served (workers loaded and connected)."""
        ...

    def generate(self, req: GenerateRequest) -> AsyncIterator[TokenBatch]: ...

    async def abort(self, request_id: str) -> None: ...

    async def stats(self) -> list[WorkerStats]: ...

    async def prefix_index_agreement(self) -> list[IndexAgreement]:
        """The router's prefix index against each live worker's cached blocks."""
        ...

    def routing_decisions(self) -> dict[tuple[str, str, str], int]:
        """Requests routed so far by ``(role, policy, reason)``."""
        ...


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

    async def prefix_index_agreement(self) -> list[IndexAgreement]:
        return await self.client.prefix_index_agreement()

    def routing_decisions(self) -> dict[tuple[str, str, str], int]:
        return dict(self.client.decisions)

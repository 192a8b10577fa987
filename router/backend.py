"""What the router needs from the serving cluster; the HTTP layer sees nothing else."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

from transfer.messages import GenerateRequest, TokenBatch, WorkerStats


class Backend(Protocol):
    """A source of token streams.

    ``generate`` yields ``TokenBatch`` items until one has ``finished`` set and
    raises ``transfer.messages.RequestFailed`` when the request cannot be served.
    Closing the iterator early (``aclose``) aborts the request wherever it runs.
    """

    model_name: str

    def is_ready(self) -> bool:
        """True once requests can be served (workers loaded and connected)."""
        ...

    def generate(self, req: GenerateRequest) -> AsyncIterator[TokenBatch]: ...

    async def abort(self, request_id: str) -> None: ...

    async def stats(self) -> list[WorkerStats]: ...

    def routing_decisions(self) -> dict[tuple[str, str, str], int]:
        """Requests routed so far by ``(role, policy, reason)``."""
        ...

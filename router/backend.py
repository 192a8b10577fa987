"""What the router needs from the serving cluster; the HTTP layer sees nothing else."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import TYPE_CHECKING, Any, Protocol

from messages.wire import GenerateRequest, TokenBatch, WorkerStats
from router.errors import AddRefused

if TYPE_CHECKING:
    from router.client import PDClient
    from router.drain import DrainReport, Retire
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

    def drain(self, worker_id: str, deadline_s: float) -> asyncio.Task[DrainReport]:
        """Take a worker out of routing before returning, and drain it in the background
        (``router.drain``); the task's result is its report. Raises ``router.errors.DrainRefused``."""
        ...

    def draining(self) -> list[str]:
        """Ids of the workers draining now."""
        ...

    def add_worker(self, role: str) -> asyncio.Task[str]:
        """Start one more ``role`` worker in the background; the task's result is its id once it
        serves (it raises what made the start fail, the worker then removed). Raises
        ``router.errors.AddRefused`` before starting."""
        ...


async def _keep(worker_id: str) -> None:
    logging.getLogger(__name__).warning("%s drained; nothing retires its actor here", worker_id)


Launch = Callable[[str], Coroutine[Any, Any, str]]


class ClusterBackend:
    """Ready once ``start`` has connected every worker and there is at least one decode worker and
    at least one prefill worker (or none at all: colocated mode, where decode runs whole requests).

    ``retire`` is how a drained worker's actor goes and ``launch`` how a new one comes (start it, let it
    join, answer its id): the cluster sets both (``cluster.fleet``); without ``launch`` no worker can be
    added."""

    def __init__(self, client: PDClient, model_name: str, colocated: bool = False,
                 retire: Retire | None = None) -> None:
        if colocated and client.prefill:
            raise ValueError("a colocated backend has no prefill workers")
        self.client = client
        self.model_name = model_name
        self.colocated = colocated
        self.retire: Retire = retire or _keep
        self.launch: Launch | None = None
        self._started = False
        self._drains: set[asyncio.Task[DrainReport]] = set()
        self._joins: set[asyncio.Task[str]] = set()

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

    def drain(self, worker_id: str, deadline_s: float) -> asyncio.Task[DrainReport]:
        drainer = self.client.drainer
        worker = drainer.begin(worker_id)
        task = asyncio.get_running_loop().create_task(drainer.finish(worker, deadline_s, self.retire))
        self._drains.add(task)
        task.add_done_callback(self._drains.discard)
        return task

    def draining(self) -> list[str]:
        return self.client.table.draining()

    def add_worker(self, role: str) -> asyncio.Task[str]:
        if self.launch is None:
            raise AddRefused(409, "This server cannot start workers.", "not_supported")
        if role == "prefill" and self.colocated:
            raise AddRefused(409, "A colocated server runs no prefill workers.", "colocated")
        task = asyncio.get_running_loop().create_task(self.launch(role))
        self._joins.add(task)
        task.add_done_callback(self._joins.discard)
        return task

"""Workers joining and leaving a cluster while it serves: the cluster's side of scaling and drains.

``Fleet.add(role)`` starts one more worker (``WorkerGroup.launch``: a new placement group, then the
actor; the blocking Ray calls run off the event loop), waits for it to load, and has the router's
client ready and connect it (``PDClient.join``), after which requests are routed to it; a
worker that fails to join is retired and the error raised. ``Fleet.drain(worker_id, deadline_s)`` is
the router's drain (``PDClient.drain``, see ``router.drain``); its last step, ``retire``, kills
the actor without restart and removes its placement group here, so Ray never brings it back and
``/v1/workers`` no longer lists it.
"""

from __future__ import annotations

import asyncio
import logging

from cluster.workers import WorkerGroup
from router.client import PDClient
from router.drain import DrainReport
from router.worker_table import WorkerState

log = logging.getLogger("pdserve")
JOIN_TIMEOUT_S = 600.0  # a new worker's model load and connection


class Fleet:
    def __init__(self, group: WorkerGroup, client: PDClient, join_timeout: float = JOIN_TIMEOUT_S) -> None:
        self.group = group
        self.client = client
        self.join_timeout = join_timeout
        client.retire = self.retire
        client.launch = self.add

    def live(self, role: str) -> list[WorkerState]:
        """The workers of ``role`` that requests are routed to now (not draining)."""
        return self.client.table.live(role)

    async def add(self, role: str) -> str:
        """Start a worker of ``role`` and let it join routing; its id."""
        member = await asyncio.to_thread(self.group.launch, role)
        try:
            await self.client.join(role, member.actor, self.join_timeout)
        except BaseException:
            await self.retire(member.worker_id)
            raise
        log.info("pdserve: %s joined", member.worker_id)
        return member.worker_id

    async def drain(self, worker_id: str, deadline_s: float) -> DrainReport:
        """Drain a worker and remove it (``router.drain``); raises ``DrainRefused`` before starting."""
        return await self.client.drain(worker_id, deadline_s)

    async def retire(self, worker_id: str) -> None:
        if await asyncio.to_thread(self.group.retire, worker_id):
            log.info("pdserve: %s removed (actor and placement group)", worker_id)

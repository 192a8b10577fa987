"""What every serving role shares: an engine driven by an AsyncEngine, its KV events, checks.

``PrefillWorker`` and ``DecodeWorker`` subclass this and add their own role;
wire formats stay in the roles (the engine knows nothing of ``transfer/``).
"""

from __future__ import annotations

import torch

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.kv_digest import kv_digest
from engine.kv_events import EventBatch, KvEventPublisher


class EngineWorker:
    def __init__(self, worker_id: str, model: str | None, config: EngineConfig, torch_threads: int) -> None:
        torch.set_num_threads(torch_threads)
        self.worker_id = worker_id
        self.engine = LLMEngine(model, config)
        self.aengine = AsyncEngine(self.engine)
        self.events = KvEventPublisher(self.engine.kv)

    async def abort(self, request_id: str) -> None:
        await self.aengine.mutate(lambda e: e.abort_request(request_id))

    async def check_integrity(self) -> None:
        await self.aengine.mutate(lambda e: e.kv.check_integrity())

    async def kv_digest(self, request_id: str, num_tokens: int) -> str:
        """SHA-256 of the K/V bytes of a request's first ``num_tokens`` tokens (tests compare both sides)."""
        return await self.aengine.mutate(lambda e: kv_digest(e, request_id, num_tokens))

    async def drain_events(self) -> EventBatch:
        return await self.aengine.mutate(lambda e: self.events.drain())

    async def events_snapshot(self) -> tuple[int, list[int]]:
        return await self.aengine.mutate(lambda e: self.events.snapshot())

"""Numbered batches of the prefix cache's changes, for the router's prefix index."""

from __future__ import annotations

from dataclasses import dataclass

from engine.block_pool import BlockRemoved, BlockStored
from engine.kv_cache import KVCacheManager


@dataclass(frozen=True)
class EventBatch:
    seq: int
    stored: list[int]
    removed: list[int]


class KvEventPublisher:
    """Drains the pool's events into batches numbered 1, 2, ...; a snapshot carries the last number."""

    def __init__(self, kv: KVCacheManager) -> None:
        self.kv = kv
        self.seq = 0

    def drain(self) -> EventBatch:
        stored: list[int] = []
        removed: list[int] = []
        for event in self.kv.drain_events():
            if isinstance(event, BlockStored):
                stored.append(event.block_hash)
            elif isinstance(event, BlockRemoved):
                removed.append(event.block_hash)
        self.seq += 1
        return EventBatch(self.seq, stored, removed)

    def snapshot(self) -> tuple[int, list[int]]:
        """(number of the last batch drained, every hash cached now).

        Events still pending are already reflected in the hashes; replaying them
        on top of the snapshot leaves every hash in its latest state, so a reader
        can take the snapshot and continue with batch ``seq + 1``.
        """
        return self.seq, self.kv.pool.announced_hashes()

"""The router's exact prefix index: block hash -> workers that hold it.

Fed by each worker's numbered ``KvEvents`` batches (stored / removed block
hashes, in order). A batch whose number is not the next one expected means
events were missed: ``apply`` returns False and the caller resyncs that worker
from a ``KvSnapshot``. After events settle the index equals the union of the
workers' prefix caches (the invariant the tests check).

Hashes are the engine's chained block hashes (``engine.hashing``) with the
workers' seed, so a prompt's leading hashes can be looked up directly.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from engine.hashing import block_hashes
from messages.wire import KvEvents, KvSnapshot


class IndexAgreement(msgspec.Struct, frozen=True):
    """One worker's entry of ``GET /v1/prefix_index``: the hashes the index holds for it against the
    ones its pool caches now (a snapshot), and how many differ each way."""

    worker_id: str
    indexed_blocks: int
    cached_blocks: int
    missing: int  # cached on the worker, absent from the index
    extra: int  # in the index, no longer cached on the worker
    agrees: bool


class PrefixIndex:
    def __init__(self, block_size: int, seed: int) -> None:
        self.block_size = block_size
        self.seed = seed
        self._workers: dict[str, set[int]] = {}
        self._seq: dict[str, int] = {}

    def hashes(self, token_ids: Sequence[int]) -> list[int]:
        return block_hashes(token_ids, self.block_size, self.seed)

    def apply(self, events: KvEvents) -> bool:
        """Fold one batch in; False (and nothing applied) when a batch was missed."""
        expected = self._seq.get(events.worker_id, 0) + 1
        if events.seq != expected:
            return False
        held = self._workers.setdefault(events.worker_id, set())
        held.update(events.stored)
        held.difference_update(events.removed)
        self._seq[events.worker_id] = events.seq
        return True

    def reset(self, snapshot: KvSnapshot) -> None:
        self._workers[snapshot.worker_id] = set(snapshot.hashes)
        self._seq[snapshot.worker_id] = snapshot.seq

    def remove_worker(self, worker_id: str) -> None:
        self._workers.pop(worker_id, None)
        self._seq.pop(worker_id, None)

    def held(self, worker_id: str) -> set[int]:
        return set(self._workers.get(worker_id, ()))

    def agreement(self, snapshot: KvSnapshot) -> IndexAgreement:
        """The index against a worker's snapshot. Events not folded in yet show as a difference: once
        the worker is idle and one refresh has passed, they agree."""
        held, cached = self.held(snapshot.worker_id), set(snapshot.hashes)
        return IndexAgreement(snapshot.worker_id, len(held), len(cached), len(cached - held),
                              len(held - cached), held == cached)

    def match(self, hashes: Sequence[int], worker_id: str) -> int:
        """How many leading blocks of ``hashes`` the worker holds."""
        held = self._workers.get(worker_id)
        if not held:
            return 0
        n = 0
        for h in hashes:
            if h not in held:
                break
            n += 1
        return n

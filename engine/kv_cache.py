"""KV cache manager: which blocks each owner holds, prefix-cache lookups, hashing.

An owner is a request (or, on a prefill worker, a lease) identified by a string.
The manager keeps, per owner, the ordered list of block ids that back its tokens
(token ``t`` lives in ``blocks[t // block_size]``) and the chained hashes of its
full blocks. It never hands out part of what was asked: ``allocate`` either
covers the requested token count or changes nothing and returns False.

Invariant (``check_integrity``): every block's ref count equals the number of
owners listing it, on top of the pool's own invariants.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from engine.block_pool import BlockPool, KvEvent
from engine.hashing import ROOT_SEED, block_hashes
from engine.offload import KvOffload


@dataclass(frozen=True)
class PrefixHit:
    """Leading blocks of a token sequence already in the cache.

    ``uncached_hashes`` are the chained hashes of the full blocks after the hit
    (within the looked-up length): what the owner will compute itself.
    """

    block_ids: list[int]
    block_hashes: list[int]
    uncached_hashes: tuple[int, ...] = ()

    def num_tokens(self, block_size: int) -> int:
        return len(self.block_ids) * block_size


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        hash_seed: int = ROOT_SEED,
    ) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.hash_seed = hash_seed
        self.pool = BlockPool(num_blocks, enable_caching)
        self._blocks: dict[str, list[int]] = {}
        self._hashes: dict[str, list[int]] = {}
        self._num_cached: dict[str, int] = {}
        self._num_tokens: dict[str, int] = {}
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.offload: KvOffload | None = None
        self._windowed: set[str] = set()

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def blocks_of(self, owner: str) -> list[int]:
        return list(self._blocks.get(owner, ()))

    def holds(self, owner: str) -> bool:
        return owner in self._blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def find_prefix(self, token_ids: Sequence[int], max_tokens: int | None = None,
                    record: bool = True) -> PrefixHit:
        """Longest cached prefix of ``token_ids``, in whole blocks, of at most ``max_tokens`` tokens.

        Callers computing logits pass ``len(token_ids) - 1`` so at least one token
        is always run. Counts a prefix-cache query and its hit tokens unless
        ``record`` is False (the caller then counts it with ``record_prefix``
        once it acts on the lookup).
        """
        if not self.enable_caching:
            return PrefixHit([], [])
        limit = len(token_ids) if max_tokens is None else min(max_tokens, len(token_ids))
        hashes = block_hashes(token_ids[: (limit // self.block_size) * self.block_size],
                              self.block_size, self.hash_seed)
        ids: list[int] = []
        for h in hashes:
            block_id = self.pool.lookup(h)
            if block_id is None:
                break
            ids.append(block_id)
        if self.offload is not None and len(ids) < len(hashes):
            ids += self._restore(hashes[len(ids) :], ids)
        if record:
            self.record_prefix(len(token_ids), len(ids) * self.block_size)
        return PrefixHit(ids, hashes[: len(ids)], tuple(hashes[len(ids) :]))

    def record_prefix(self, query_tokens: int, hit_tokens: int) -> None:
        """Count one prefix-cache query of ``query_tokens`` tokens that hit ``hit_tokens``."""
        self.prefix_queries += query_tokens
        self.prefix_hits += hit_tokens

    def _restore(self, hashes: list[int], found: list[int]) -> list[int]:
        """Bring the leading ``hashes`` held by the offload tiers back into device blocks (as cached)."""
        assert self.offload is not None
        restored: list[int] = []
        self.pool.touch(found)  # the device hits must not be evicted by the restoring allocations
        try:
            for h in hashes:
                if not self.offload.contains(h) or self.pool.num_free_blocks == 0:
                    break
                block_id = self.pool.allocate(1)[0]
                restored.append(block_id)
                if not self.offload.restore(h, block_id):
                    break
                self.pool.cache_block(block_id, h)
        finally:
            self.pool.free(reversed(found + restored))
        return [b for b in restored if self.pool.blocks[b].block_hash is not None]

    def can_allocate(self, owner: str, num_tokens: int, prefix: PrefixHit | None = None) -> bool:
        held = self._blocks.get(owner)
        if held is None:
            hit = prefix.block_ids if prefix else []
            idle_hits = sum(1 for b in hit if self.pool.blocks[b].ref_cnt == 0)
            need = self.blocks_needed(num_tokens) - len(hit)
            return need <= self.pool.num_free_blocks - idle_hits
        return self.blocks_needed(num_tokens) - len(held) <= self.pool.num_free_blocks

    def allocate(self, owner: str, num_tokens: int, prefix: PrefixHit | None = None) -> bool:
        """Make ``owner`` hold blocks for its first ``num_tokens`` tokens.

        A new owner first takes ``prefix`` (cache hits, ref count + 1). Returns
        False, changing nothing, if the pool cannot cover it.
        """
        if not self.can_allocate(owner, num_tokens, prefix):
            return False
        held = self._blocks.get(owner)
        if held is None:
            held = []
            if prefix is not None and prefix.block_ids:
                self.pool.touch(prefix.block_ids)
                held.extend(prefix.block_ids)
                self._hashes[owner] = list(prefix.block_hashes)
                self._num_cached[owner] = len(prefix.block_ids)
            self._blocks[owner] = held
        need = self.blocks_needed(num_tokens) - len(held)
        if need > 0:
            held.extend(self.pool.allocate(need))
        self._num_tokens[owner] = max(num_tokens, self._num_tokens.get(owner, 0))
        return True

    def cache_blocks(self, owner: str, token_ids: Sequence[int], num_computed_tokens: int) -> None:
        """Publish ``owner``'s blocks that are full and computed under their chained hashes."""
        if not self.enable_caching or owner not in self._blocks or owner in self._windowed:
            return
        full = min(num_computed_tokens, len(token_ids)) // self.block_size
        done = self._num_cached.get(owner, 0)
        if full <= done:
            return
        hashes = self._hashes.get(owner, [])
        if len(hashes) < full:
            hashes = block_hashes(token_ids[: full * self.block_size], self.block_size,
                                  self.hash_seed, start=hashes)
            self._hashes[owner] = hashes
        blocks = self._blocks[owner]
        for i in range(done, full):
            self.pool.cache_block(blocks[i], hashes[i])
        self._num_cached[owner] = full

    def drop_block(self, owner: str, index: int) -> None:
        """Free ``owner``'s ``index``-th block (a sliding window left it); the rest shift down.

        The owner's later blocks no longer sit at ``token // block_size``, so it publishes
        nothing more to the prefix cache.
        """
        block = self._blocks[owner].pop(index)
        self._windowed.add(owner)
        self.pool.free([block])

    def shrink(self, owner: str, num_tokens: int) -> int:
        """Free ``owner``'s trailing blocks past what its first ``num_tokens`` held tokens need (the
        slots of rejected speculative tokens), tail first; returns blocks freed. Published (full,
        computed) blocks are never among them."""
        blocks = self._blocks.get(owner)
        if not blocks:
            return 0
        self._num_tokens[owner] = min(self._num_tokens.get(owner, num_tokens), num_tokens)
        keep = self.blocks_needed(num_tokens)
        extra = blocks[keep:]
        if not extra:
            return 0
        del blocks[keep:]
        self.pool.free(reversed(extra))
        return len(extra)

    def free(self, owner: str) -> int:
        """Release everything ``owner`` holds (tail blocks first). Idempotent: returns blocks freed."""
        blocks = self._blocks.pop(owner, None)
        self._windowed.discard(owner)
        self._hashes.pop(owner, None)
        self._num_cached.pop(owner, None)
        self._num_tokens.pop(owner, None)
        if not blocks:
            return 0
        self.pool.free(reversed(blocks))
        return len(blocks)

    def drain_events(self) -> list[KvEvent]:
        return self.pool.drain_events()

    def num_stored_tokens(self) -> int:
        """Tokens the held blocks store, each shared block counted once.

        An owner that asked room for ``n`` tokens fills ``min(block_size, n - i * block_size)``
        slots of its ``i``-th block; a block shared by several owners counts its fullest use.
        Divided by ``pool.num_used_blocks * block_size`` this is the KV memory utilisation
        (1.0 = no slot of a held block is empty).
        """
        fill: dict[int, int] = {}
        bs = self.block_size
        for owner, blocks in self._blocks.items():
            n = self._num_tokens.get(owner, len(blocks) * bs)
            for i, block in enumerate(blocks):
                used = max(0, min(bs, n - i * bs))
                if used > fill.get(block, 0):
                    fill[block] = used
        return sum(fill.values())

    def num_owners(self) -> int:
        return len(self._blocks)

    def check_integrity(self) -> None:
        self.pool.check_integrity()
        holders: Counter[int] = Counter()
        for blocks in self._blocks.values():
            holders.update(blocks)
        for block in self.pool.blocks:
            held_by = holders.get(block.block_id, 0)
            assert block.ref_cnt == held_by, f"block {block.block_id}: ref count {block.ref_cnt} != {held_by}"

"""KV cache manager: which blocks each owner holds, per KV group, prefix-cache lookups, hashing.

An owner is a request (or, on a prefill worker, a lease) identified by a string. The model's layers
form KV groups (``engine/kv_groups.py``: one for a model of full-attention layers); the manager
keeps, per owner and group, the ordered table of block ids that back its tokens (token ``t`` lives
in ``table[t // block_size]``, positions absolute) and the chained hashes of its full blocks. A
sliding-window group's entries its window has left are ``NULL_BLOCK`` and their blocks are back in
the pool (``release_outside_window``). Every group draws from the one ``BlockPool``; a group's block
is cached under ``group_hash(hash, group)`` so groups never share blocks, and only group 0's are
announced to the router. The manager never hands out part of what was asked: ``allocate`` either
covers the requested token count in every group or changes nothing and returns False.

A prefix hit is the longest run of whole blocks for which every full-attention group holds every
block and every sliding group the blocks its window reads at the hit's end.

Invariant (``check_integrity``): every block's ref count equals the number of table entries listing
it, over every owner and group, on top of the pool's own invariants.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from engine.block_pool import BlockPool, KvEvent
from engine.hashing import ROOT_SEED, block_hashes, group_hash
from engine.kv_groups import NULL_BLOCK, KvGroup
from engine.offload import KvOffload

FULL = (KvGroup(()),)  # one full-attention group: a model without sliding layers


@dataclass(frozen=True)
class PrefixHit:
    """Leading blocks of a token sequence already in the cache, per group (``tables``; a sliding
    group's blocks outside its window are ``NULL_BLOCK``).

    ``block_hashes`` are the hit blocks' chained hashes; ``uncached_hashes`` those of the full blocks
    after the hit (within the looked-up length): what the owner will compute itself.
    """

    tables: list[list[int]]
    block_hashes: list[int]
    uncached_hashes: tuple[int, ...] = ()

    @property
    def block_ids(self) -> list[int]:
        """Group 0's blocks."""
        return self.tables[0]

    @property
    def num_blocks(self) -> int:
        return len(self.block_hashes)

    def num_tokens(self, block_size: int) -> int:
        return self.num_blocks * block_size


@dataclass
class _Owner:
    tables: list[list[int]]
    hashes: list[int] = field(default_factory=list)
    num_cached: int = 0  # leading full blocks published
    num_tokens: int = 0
    windowed: bool = False  # --kv-window dropped a block: tables no longer sit at token // block_size
    dropped_tokens: int = 0  # tokens of the blocks dropped (``drop_block``, ``compressed``)


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        hash_seed: int = ROOT_SEED,
        groups: tuple[KvGroup, ...] = FULL,
    ) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.hash_seed = hash_seed
        self.groups = groups
        self.pool = BlockPool(num_blocks, enable_caching)
        self._owners: dict[str, _Owner] = {}
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.offload: KvOffload | None = None

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    @property
    def hybrid(self) -> bool:
        """Whether the model has more than one KV group."""
        return len(self.groups) > 1

    def blocks_of(self, owner: str) -> list[int]:
        """Group 0's table of ``owner`` (a copy)."""
        held = self._owners.get(owner)
        return list(held.tables[0]) if held else []

    def tables_of(self, owner: str) -> list[list[int]]:
        """Every group's table of ``owner`` (copies)."""
        held = self._owners.get(owner)
        return [list(t) for t in held.tables] if held else [[] for _ in self.groups]

    def holds(self, owner: str) -> bool:
        return owner in self._owners

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _key(self, block_hash: int, group: int) -> int:
        return group_hash(block_hash, group)

    def find_prefix(self, token_ids: Sequence[int], max_tokens: int | None = None,
                    record: bool = True) -> PrefixHit:
        """Longest cached prefix of ``token_ids``, in whole blocks, of at most ``max_tokens`` tokens.

        Callers computing logits pass ``len(token_ids) - 1`` so at least one token
        is always run. Counts a prefix-cache query and its hit tokens unless
        ``record`` is False (the caller then counts it with ``record_prefix``
        once it acts on the lookup).
        """
        empty: list[list[int]] = [[] for _ in self.groups]
        if not self.enable_caching:
            return PrefixHit(empty, [])
        limit = len(token_ids) if max_tokens is None else min(max_tokens, len(token_ids))
        hashes = block_hashes(token_ids[: (limit // self.block_size) * self.block_size],
                              self.block_size, self.hash_seed)
        if self.hybrid:
            tables = self._hybrid_hit(hashes)
        else:
            ids: list[int] = []
            for h in hashes:
                block_id = self.pool.lookup(h)
                if block_id is None:
                    break
                ids.append(block_id)
            if self.offload is not None and len(ids) < len(hashes):
                ids += self._restore(hashes[len(ids) :], ids)
            tables = [ids]
        hit = len(tables[0])
        if record:
            self.record_prefix(len(token_ids), hit * self.block_size)
        return PrefixHit(tables, hashes[:hit], tuple(hashes[hit:]))

    def _hybrid_hit(self, hashes: list[int]) -> list[list[int]]:
        """The longest hit every group can serve (see the module docstring), as per-group tables."""
        n = len(hashes)
        for g, group in enumerate(self.groups):
            if group.window is None:
                found = 0
                while found < n and self.pool.lookup(self._key(hashes[found], g)) is not None:
                    found += 1
                n = found
        while n > 0 and not all(
                self.pool.lookup(self._key(hashes[j], g)) is not None
                for g, group in enumerate(self.groups) if group.window is not None
                for j in range(group.first_needed(n * self.block_size, self.block_size), n)):
            n -= 1
        tables = []
        for g, group in enumerate(self.groups):
            first = group.first_needed(n * self.block_size, self.block_size)
            ids = [self.pool.lookup(self._key(hashes[j], g)) for j in range(first, n)]
            tables.append([NULL_BLOCK] * first + [b for b in ids if b is not None])
        return tables

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

    def _new_blocks(self, owner: str, num_tokens: int, prefix: PrefixHit | None) -> int:
        held = self._owners.get(owner)
        want = self.blocks_needed(num_tokens)
        if held is None:
            hit = prefix.num_blocks if prefix is not None else 0
            return len(self.groups) * max(want - hit, 0)
        return sum(max(want - len(table), 0) for table in held.tables)

    def can_allocate(self, owner: str, num_tokens: int, prefix: PrefixHit | None = None) -> bool:
        idle_hits = 0
        if owner not in self._owners and prefix is not None:
            hit = {b for table in prefix.tables for b in table if b != NULL_BLOCK}
            idle_hits = sum(1 for b in hit if self.pool.blocks[b].ref_cnt == 0)
        return self._new_blocks(owner, num_tokens, prefix) <= self.pool.num_free_blocks - idle_hits

    def allocate(self, owner: str, num_tokens: int, prefix: PrefixHit | None = None) -> bool:
        """Make ``owner`` hold blocks for its first ``num_tokens`` tokens in every group.

        A new owner first takes ``prefix`` (cache hits, ref count + 1). Returns
        False, changing nothing, if the pool cannot cover it.
        """
        if not self.can_allocate(owner, num_tokens, prefix):
            return False
        held = self._owners.get(owner)
        if held is None:
            held = _Owner([[] for _ in self.groups])
            if prefix is not None and prefix.num_blocks:
                for table, hit in zip(held.tables, prefix.tables, strict=True):
                    self.pool.touch(b for b in hit if b != NULL_BLOCK)
                    table.extend(hit)
                held.hashes = list(prefix.block_hashes)
                held.num_cached = prefix.num_blocks
            self._owners[owner] = held
        want = self.blocks_needed(num_tokens)
        for table in held.tables:
            if want > len(table):
                table.extend(self.pool.allocate(want - len(table)))
        held.num_tokens = max(num_tokens, held.num_tokens)
        return True

    def cache_blocks(self, owner: str, token_ids: Sequence[int], num_computed_tokens: int) -> None:
        """Publish ``owner``'s blocks that are full and computed, in every group, under their chained
        hashes (group 0's announced)."""
        held = self._owners.get(owner)
        if not self.enable_caching or held is None or held.windowed:
            return
        full = min(num_computed_tokens, len(token_ids)) // self.block_size
        if full <= held.num_cached:
            return
        if len(held.hashes) < full:
            held.hashes = block_hashes(token_ids[: full * self.block_size], self.block_size,
                                       self.hash_seed, start=held.hashes)
        for g, table in enumerate(held.tables):
            for i in range(held.num_cached, full):
                if table[i] != NULL_BLOCK:
                    self.pool.cache_block(table[i], self._key(held.hashes[i], g), announce=g == 0)
        held.num_cached = full

    def release_outside_window(self, owner: str, next_position: int) -> int:
        """Give back each sliding group's blocks that no query from ``next_position`` on reads (they stay
        in the prefix cache until evicted); returns blocks released."""
        held = self._owners.get(owner)
        if held is None:
            return 0
        released: list[int] = []
        for group, table in zip(self.groups, held.tables, strict=True):
            for i in range(min(group.first_needed(next_position, self.block_size), len(table))):
                if table[i] != NULL_BLOCK:
                    released.append(table[i])
                    table[i] = NULL_BLOCK
        self.pool.free(released)
        return len(released)

    def drop_block(self, owner: str, index: int) -> None:
        """Free ``owner``'s ``index``-th block (``--kv-window`` left it; one KV group); the rest shift down.

        The owner's later blocks no longer sit at ``token // block_size``, so it publishes
        nothing more to the prefix cache.
        """
        held = self._owners[owner]
        block = held.tables[0].pop(index)
        held.windowed = True
        held.dropped_tokens += self.block_size
        self.pool.free([block])

    def dropped_tokens(self, owner: str) -> int:
        """Tokens of the blocks ``owner`` has dropped (``drop_block``) or arrived without (``compressed``)."""
        held = self._owners.get(owner)
        return held.dropped_tokens if held is not None else 0

    def compressed(self, owner: str, kept_tokens: int, dropped_tokens: int) -> bool:
        """Make ``owner`` hold fresh blocks for ``kept_tokens`` tokens of a sequence that lost
        ``dropped_tokens`` before it came here (a compressed sequence handed over; one KV group): what it
        held is freed first and no prefix hit is taken; with tokens dropped it publishes nothing (its
        table no longer sits at ``token // block_size``). False, holding nothing, when the pool cannot
        cover it."""
        self.free(owner)
        if not self.allocate(owner, kept_tokens):
            return False
        held = self._owners[owner]
        held.windowed = dropped_tokens > 0
        held.dropped_tokens = dropped_tokens
        return True

    def shrink(self, owner: str, num_tokens: int) -> int:
        """Free ``owner``'s trailing blocks past what its first ``num_tokens`` held tokens need (the
        slots of rejected speculative tokens), tail first; returns blocks freed. Published (full,
        computed) blocks are never among them."""
        held = self._owners.get(owner)
        if held is None or not held.tables[0]:
            return 0
        held.num_tokens = min(held.num_tokens or num_tokens, num_tokens)
        keep = self.blocks_needed(num_tokens)
        freed = 0
        for table in held.tables:
            extra = [b for b in table[keep:] if b != NULL_BLOCK]
            del table[keep:]
            self.pool.free(reversed(extra))
            freed += len(extra)
        return freed

    def free(self, owner: str) -> int:
        """Release everything ``owner`` holds (tail blocks first). Idempotent: returns blocks freed."""
        held = self._owners.pop(owner, None)
        if held is None:
            return 0
        blocks = [b for table in held.tables for b in reversed(table) if b != NULL_BLOCK]
        self.pool.free(blocks)
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
        for held in self._owners.values():
            for table in held.tables:
                n = held.num_tokens or len(table) * bs
                for i, block in enumerate(table):
                    used = max(0, min(bs, n - i * bs))
                    if block != NULL_BLOCK and used > fill.get(block, 0):
                        fill[block] = used
        return sum(fill.values())

    def num_owners(self) -> int:
        return len(self._owners)

    def check_integrity(self) -> None:
        self.pool.check_integrity()
        holders: Counter[int] = Counter()
        for held in self._owners.values():
            for table in held.tables:
                holders.update(b for b in table if b != NULL_BLOCK)
        for block in self.pool.blocks:
            held_by = holders.get(block.block_id, 0)
            assert block.ref_cnt == held_by, f"block {block.block_id}: ref count {block.ref_cnt} != {held_by}"

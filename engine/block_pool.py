"""The block pool: plain Python over integer block ids, no torch.

Every block is in exactly one of three states:

* free: ref count 0, no hash; in the free queue.
* cached: ref count 0, holds a hash (its content is a reusable prefix); in the
  free queue, so it is evicted when a fresh block is needed.
* in use: ref count > 0 (one per request or lease that holds it); not in the
  free queue; may also hold a hash (shared prefix blocks).

``free + cached + in_use == num_blocks`` always. The free queue is an O(1)
doubly linked LRU: blocks are taken from the front and returned to the back, so
the cached block released longest ago is evicted first. Callers free a
sequence's blocks tail-first, so a sequence's last blocks go before its prefix.

Events: every announced hash that enters or leaves the cache is recorded as a
``BlockStored``/``BlockRemoved`` event; ``drain_events()`` hands them out (the
router's prefix index is fed from them). A hybrid model's other KV groups cache
their blocks unannounced (``cache_block(..., announce=False)``): the router
indexes the first group's blocks only.

``on_evict(block_id, block_hash)``, when set, is called when a cached block is
handed out again, before its new owner writes it (the offload tier copies it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass


class Block:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "announced", "prev", "next")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: int | None = None
        self.announced = False
        self.prev: Block | None = None
        self.next: Block | None = None


class FreeBlockQueue:
    """Doubly linked list of blocks with O(1) popleft, append and remove."""

    def __init__(self, blocks: Iterable[Block]) -> None:
        self._head = Block(-1)
        self._tail = Block(-2)
        self._head.next = self._tail
        self._tail.prev = self._head
        self.size = 0
        for block in blocks:
            self.append(block)

    def append(self, block: Block) -> None:
        last = self._tail.prev
        assert last is not None
        last.next = block
        block.prev = last
        block.next = self._tail
        self._tail.prev = block
        self.size += 1

    def remove(self, block: Block) -> None:
        if block.prev is None or block.next is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        block.prev.next = block.next
        block.next.prev = block.prev
        block.prev = block.next = None
        self.size -= 1

    def popleft(self) -> Block:
        first = self._head.next
        if first is None or first is self._tail:
            raise ValueError("no free blocks")
        self.remove(first)
        return first

    def __iter__(self) -> Iterator[Block]:
        node = self._head.next
        while node is not None and node is not self._tail:
            yield node
            node = node.next

    def ids(self) -> list[int]:
        return [b.block_id for b in self]


@dataclass(frozen=True)
class BlockStored:
    block_hash: int
    block_id: int


@dataclass(frozen=True)
class BlockRemoved:
    block_hash: int
    block_id: int


KvEvent = BlockStored | BlockRemoved


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"a block pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[int, Block] = {}
        self.num_evictions = 0
        self._events: list[KvEvent] = []
        self.on_evict: Callable[[int, int], None] | None = None

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (free plus evictable cached)."""
        return self.free_queue.size

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.free_queue.size

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def announced_hashes(self) -> list[int]:
        """Every hash cached now that was announced (what the router's index mirrors)."""
        return [h for h, block in self.cached.items() if block.announced]

    def num_cached_free_blocks(self) -> int:
        return sum(1 for b in self.cached.values() if b.ref_cnt == 0)

    def lookup(self, block_hash: int) -> int | None:
        block = self.cached.get(block_hash)
        return None if block is None else block.block_id

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` blocks from the LRU front, evicting cached ones; ref count 1 each."""
        if n > self.free_queue.size:
            raise ValueError(f"cannot allocate {n} blocks: only {self.free_queue.size} free")
        out = []
        for _ in range(n):
            block = self.free_queue.popleft()
            if block.block_hash is not None and self.on_evict is not None:
                self.on_evict(block.block_id, block.block_hash)
            self._evict(block)
            block.ref_cnt = 1
            out.append(block.block_id)
        return out

    def touch(self, block_ids: Iterable[int]) -> None:
        """Add a holder to each block (a prefix-cache hit); pulls idle ones off the free queue."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one holder from each block, in the order given; idle blocks go to the LRU back."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_cnt <= 0:
                raise ValueError(f"double free of block {block_id}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None or not self.enable_caching:
                    self._evict(block)
                self.free_queue.append(block)

    def cache_block(self, block_id: int, block_hash: int, announce: bool = True) -> bool:
        """Publish a full, held block under its chained hash (an event unless not ``announce``). False if
        the hash is already cached."""
        if not self.enable_caching:
            return False
        block = self.blocks[block_id]
        if block.ref_cnt <= 0:
            raise ValueError(f"cannot cache block {block_id}: it is not held")
        if block.block_hash is not None:
            if block.block_hash != block_hash:
                raise ValueError(f"block {block_id} already holds another hash")
            return False
        if block_hash in self.cached:
            return False
        block.block_hash = block_hash
        block.announced = announce
        self.cached[block_hash] = block
        if announce:
            self._events.append(BlockStored(block_hash, block_id))
        return True

    def reset_prefix_cache(self) -> int:
        """Forget every idle cached block; returns how many were dropped."""
        dropped = 0
        for block in list(self.cached.values()):
            if block.ref_cnt == 0:
                self._evict(block)
                dropped += 1
        return dropped

    def drain_events(self) -> list[KvEvent]:
        events, self._events = self._events, []
        return events

    def _evict(self, block: Block) -> None:
        if block.block_hash is None:
            return
        if self.cached.get(block.block_hash) is block:
            del self.cached[block.block_hash]
            if block.announced:
                self._events.append(BlockRemoved(block.block_hash, block.block_id))
            self.num_evictions += 1
        block.block_hash = None
        block.announced = False

    def check_integrity(self) -> None:
        """Raise AssertionError if any invariant of the module docstring is broken."""
        in_queue = {b.block_id for b in self.free_queue}
        assert len(in_queue) == self.free_queue.size, "free queue size drifted"
        free = cached = in_use = 0
        for block in self.blocks:
            assert block.ref_cnt >= 0, f"block {block.block_id} has negative ref count"
            if block.ref_cnt == 0:
                assert block.block_id in in_queue, f"idle block {block.block_id} missing from free queue"
                if block.block_hash is None:
                    free += 1
                else:
                    cached += 1
            else:
                assert block.block_id not in in_queue, f"held block {block.block_id} in free queue"
                in_use += 1
            if block.block_hash is not None:
                assert self.cached.get(block.block_hash) is block, f"block {block.block_id} hash not indexed"
        for block_hash, block in self.cached.items():
            assert block.block_hash == block_hash, "cache index points at a block with another hash"
        assert free + cached + in_use == self.num_blocks, "free + cached + in_use != total"

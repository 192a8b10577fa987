"""Block pool and KV manager: exact block ids, LRU eviction order, ref counts."""

import pytest

from engine.block_pool import BlockPool, BlockRemoved, BlockStored
from engine.hashing import block_hashes, hash_block, seed_for
from engine.kv_cache import KVCacheManager


def test_allocate_takes_lowest_ids_first_and_free_returns_to_back() -> None:
    pool = BlockPool(6)
    assert pool.allocate(2) == [0, 1]
    assert pool.allocate(1) == [2]
    pool.free([1, 0])
    assert pool.free_queue.ids() == [3, 4, 5, 1, 0]
    assert pool.allocate(4) == [3, 4, 5, 1]
    pool.check_integrity()


def test_ref_counts_and_double_free() -> None:
    pool = BlockPool(4)
    [b] = pool.allocate(1)
    pool.touch([b])
    assert pool.blocks[b].ref_cnt == 2
    pool.free([b])
    assert pool.blocks[b].ref_cnt == 1 and pool.num_free_blocks == 3
    pool.free([b])
    assert pool.num_free_blocks == 4
    with pytest.raises(ValueError, match="double free"):
        pool.free([b])
    pool.check_integrity()


def test_cached_blocks_evicted_in_lru_order_with_events() -> None:
    pool = BlockPool(4)
    a, b, c, d = pool.allocate(4)
    for block, h in zip((a, b, c, d), (101, 102, 103, 104), strict=True):
        assert pool.cache_block(block, h)
    pool.free([c])
    pool.free([a])
    pool.free([d])
    pool.free([b])
    assert pool.free_queue.ids() == [c, a, d, b]
    pool.drain_events()
    assert pool.allocate(2) == [c, a]
    assert pool.lookup(103) is None and pool.lookup(101) is None
    assert pool.lookup(104) == d
    assert pool.drain_events() == [BlockRemoved(103, c), BlockRemoved(101, a)]
    pool.touch([d])
    assert pool.free_queue.ids() == [b]
    pool.check_integrity()


def test_duplicate_hash_is_not_cached_twice() -> None:
    pool = BlockPool(3)
    a, b = pool.allocate(2)
    assert pool.cache_block(a, 7)
    assert not pool.cache_block(b, 7)
    assert pool.drain_events() == [BlockStored(7, a)]
    pool.free([a, b])
    pool.check_integrity()


def test_caching_disabled_forgets_everything() -> None:
    pool = BlockPool(2, enable_caching=False)
    [a] = pool.allocate(1)
    assert not pool.cache_block(a, 5)
    pool.free([a])
    assert pool.lookup(5) is None
    pool.check_integrity()


def test_chained_hashes_depend_on_whole_prefix() -> None:
    x = block_hashes(list(range(10)), 4)
    assert len(x) == 2
    y = block_hashes([99] + list(range(1, 10)), 4)
    assert x[1] != y[1]
    assert block_hashes(list(range(12)), 4, start=x)[:2] == x
    assert hash_block(x[0], list(range(4, 8))) == x[1]
    eight = list(range(8))
    assert block_hashes(eight, 4, seed=seed_for("a")) != block_hashes(eight, 4, seed=seed_for("b"))


def test_kv_manager_prefix_reuse_and_tail_first_free() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    tokens = list(range(10))
    assert kv.allocate("a", 10)
    assert kv.blocks_of("a") == [0, 1, 2]
    kv.cache_blocks("a", tokens, 10)
    hit = kv.find_prefix(tokens + [50, 51], max_tokens=11)
    assert hit.block_ids == [0, 1]
    assert kv.allocate("b", 12, hit)
    assert kv.blocks_of("b") == [0, 1, 3]
    assert kv.pool.blocks[0].ref_cnt == 2
    kv.check_integrity()
    assert kv.free("a") == 3
    assert kv.free("a") == 0
    assert kv.pool.free_queue.ids()[-1:] == [2]
    kv.free("b")
    # b freed tail first: its own block 3, then shared blocks 1 and 0 (now idle)
    assert kv.pool.free_queue.ids()[-4:] == [2, 3, 1, 0]
    kv.check_integrity()
    assert kv.pool.num_used_blocks == 0


def test_kv_manager_allocation_is_all_or_nothing() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=4)
    assert kv.allocate("a", 8)
    assert not kv.allocate("b", 8)
    assert not kv.holds("b")
    assert kv.allocate("b", 4)
    assert not kv.allocate("b", 5)
    assert kv.blocks_of("b") == [2]
    kv.check_integrity()


def test_idle_prefix_hits_count_against_free_blocks() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=2)
    kv.allocate("a", 4)
    kv.cache_blocks("a", [1, 2, 3, 4], 4)
    kv.free("a")
    hit = kv.find_prefix([1, 2, 3, 4, 5], 4)
    assert hit.block_ids == [0, 1]
    # 3 blocks needed, 2 are hits (idle, so in the free count): 1 fresh block + 2 touched == 3 free
    assert kv.allocate("b", 5, hit)
    assert kv.blocks_of("b") == [0, 1, 2]
    assert kv.num_free_blocks == 0
    kv.check_integrity()

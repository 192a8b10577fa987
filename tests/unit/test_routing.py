"""Prefix index folding KV events, and the routing policies' choices."""

import time

from engine.hashing import ROOT_SEED, block_hashes
from messages.wire import KvEvents, KvSnapshot
from router.handles import DecodeHandle
from router.policy import Candidate, LeastLoaded, PrefixAware, RoundRobin, make_policy
from router.prefix_index import PrefixIndex
from router.worker_table import WorkerState, WorkerTable
from tests.fakes import FakeActor


def test_index_folds_events_in_order_and_detects_gaps() -> None:
    index = PrefixIndex(block_size=4, seed=ROOT_SEED)
    tokens = list(range(12))
    h = index.hashes(tokens)
    assert h == block_hashes(tokens, 4, ROOT_SEED)
    assert index.apply(KvEvents("w0", 1, stored=h, removed=[]))
    assert index.match(h, "w0") == 3
    assert index.apply(KvEvents("w0", 2, stored=[], removed=[h[1]]))
    assert index.match(h, "w0") == 1
    assert not index.apply(KvEvents("w0", 4, stored=[h[1]], removed=[]))
    assert index.match(h, "w0") == 1
    index.reset(KvSnapshot("w0", 4, h))
    assert index.match(h, "w0") == 3
    assert index.apply(KvEvents("w0", 5, stored=[], removed=[]))
    index.remove_worker("w0")
    assert index.match(h, "w0") == 0


def cands(*rows: tuple[int, int, int]) -> list[Candidate]:
    return [Candidate(i, f"w{i}", p, load, free) for i, (p, load, free) in enumerate(rows)]


def test_prefix_policy_prefers_held_prefix_until_load_outweighs_it() -> None:
    policy = PrefixAware()
    chosen, reason = policy.pick("prefill", cands((0, 0, 100), (1024, 200, 100)), 1100, 10)
    assert (chosen.index, reason) == (1, "prefix_hit")
    chosen, reason = policy.pick("prefill", cands((0, 0, 100), (1024, 5000, 100)), 1100, 10)
    assert (chosen.index, reason) == (0, "load")
    # cache-first: the holder is busy with another new prompt (1,100 tokens queued) while the other
    # worker idles; computing the prefix there would cost as much now and a second copy later
    chosen, reason = policy.pick("prefill", cands((0, 0, 100), (1024, 1100, 100)), 1100, 10)
    assert (chosen.index, reason) == (1, "prefix_hit")
    plain = PrefixAware(cache_weight=1.0)
    assert plain.pick("prefill", cands((0, 0, 100), (1024, 1100, 100)), 1100, 10)[0].index == 0
    # up to about twice the missing tokens of extra load
    assert policy.pick("prefill", cands((0, 0, 100), (1024, 2000, 100)), 1100, 10)[0].index == 1
    assert policy.pick("prefill", cands((0, 0, 100), (1024, 2300, 100)), 1100, 10)[0].index == 0


def test_policies_skip_workers_without_room() -> None:
    rows = cands((1024, 0, 2), (0, 0, 100))
    assert PrefixAware().pick("decode", rows, 1100, 70)[0].index == 1
    assert LeastLoaded().pick("decode", rows, 1100, 70)[0].index == 1
    assert PrefixAware().pick("decode", cands((0, 0, 5), (0, 0, 9)), 10, 70)[0].index == 1


def test_round_robin_and_least_loaded() -> None:
    rr = RoundRobin()
    rows = cands((0, 0, 10), (0, 0, 10), (0, 0, 10))
    assert [rr.pick("prefill", rows, 8, 1)[0].index for _ in range(4)] == [0, 1, 2, 0]
    assert rr.pick("decode", rows, 8, 1)[0].index == 0
    assert LeastLoaded().pick("decode", cands((0, 50, 10), (0, 10, 10)), 8, 1)[0].index == 1
    assert make_policy("prefix").name == "prefix"


def two_decoders() -> tuple[WorkerTable, WorkerState, WorkerState]:
    table = WorkerTable([], [DecodeHandle(FakeActor()), DecodeHandle(FakeActor())], call_timeout=1.0)
    table.index = PrefixIndex(block_size=4, seed=ROOT_SEED)
    a, b = table.decode
    a.worker_id, b.worker_id = "d0", "d1"
    a.free_blocks = b.free_blocks = 1000
    return table, a, b


def test_prefix_sent_to_a_worker_counts_as_held_before_it_is_published() -> None:
    table, a, b = two_decoders()
    assert table.index is not None
    h = table.index.hashes(list(range(16)))
    a.add_pending("r1", h[:3], ttl=30.0)
    rows = table.candidates([a, b], h, block_size=4)
    assert [r.prefix_tokens for r in rows] == [12, 0]
    assert PrefixAware().pick("decode", rows, 16, 5)[0].worker_id == "d0"
    other = table.index.hashes([7] + list(range(1, 16)))
    assert a.pending_match(other) == (0, 0)


def test_pending_prefix_routing_follows_it_until_published_failed_or_expired() -> None:
    table, a, b = two_decoders()
    assert table.index is not None
    h = table.index.hashes(list(range(1040)))  # 260 blocks of 4
    # the first request of a prefix went to d0 and is being computed there: its whole prompt is
    # d0's load, but it is the prefix the second request needs, so d0 still wins
    a.add_pending("r1", h, ttl=30.0)
    a.inflight_tokens = 1040
    rows = table.candidates([a, b], h[:256], block_size=4, num_tokens=1030)
    assert [(r.prefix_tokens, r.shared_load_tokens) for r in rows] == [(1024, 1024), (0, 0)]
    assert PrefixAware().pick("prefill", rows, 1030, 258)[0].worker_id == "d0"
    # another worker's in-flight work is plain load: an unrelated prompt goes to the idle one
    unrelated = table.index.hashes([5] * 1030)
    rows = table.candidates([a, b], unrelated, 4, 1030)
    assert [r.shared_load_tokens for r in rows] == [0, 0]
    assert PrefixAware().pick("prefill", rows, 1030, 258)[0].worker_id == "d1"
    # served: kept (no longer discounting load) until a KV-events batch drained later is folded in
    a.inflight_tokens = 0
    a.settle("r1", ok=True, ttl=30.0)
    assert a.pending_match(h) == (260, 0)
    a.drop_published(drained_after=a.pending["r1"].served_at - 1.0)  # type: ignore[operator]
    assert "r1" in a.pending
    a.drop_published(drained_after=time.monotonic())
    assert a.pending_match(h) == (0, 0)
    # failed: dropped at once; expired: dropped at the next match
    a.add_pending("r2", h, ttl=30.0)
    a.settle("r2", ok=False, ttl=30.0)
    a.add_pending("r3", h, ttl=0.0)
    b.add_pending("r4", h, ttl=30.0)
    b.settle("r4", ok=True, ttl=0.0)
    rows = table.candidates([a, b], h, block_size=4, num_tokens=1040)
    assert [r.prefix_tokens for r in rows] == [0, 0] and not a.pending and not b.pending


def test_round_robin_ignores_pending_prefixes() -> None:
    table, a, b = two_decoders()
    assert table.index is not None
    h = table.index.hashes(list(range(64)))
    a.add_pending("r1", h, ttl=30.0)
    rr = RoundRobin()
    picks = [rr.pick("decode", table.candidates([a, b], h, 4, 64), 64, 17)[0].worker_id for _ in range(4)]
    assert picks == ["d0", "d1", "d0", "d1"]


def test_room_counts_only_the_blocks_a_worker_lacks() -> None:
    holder = Candidate(0, "w0", prefix_tokens=1024, load_tokens=0, free_blocks=4, need_blocks=3)
    empty = Candidate(1, "w1", prefix_tokens=0, load_tokens=0, free_blocks=100, need_blocks=67)
    assert PrefixAware().pick("decode", [holder, empty], 1050, 67)[0].worker_id == "w0"

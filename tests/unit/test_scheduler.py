"""Scheduler: token budget, chunked prefill, decode priority, prefix reuse, preemption."""

from engine.kv_cache import KVCacheManager
from engine.request import Request, RequestStatus
from engine.sampling import SamplingParams
from engine.scheduler import Scheduler, SchedulerOutput


def make(kv_blocks: int = 16, budget: int = 8, seqs: int = 4, block: int = 4) -> Scheduler:
    return Scheduler(KVCacheManager(kv_blocks, block), budget, seqs, max_model_len=64)


def req(rid: str, n: int, first: int = 0, priority: int = 0, t: float = 0.0) -> Request:
    return Request(rid, list(range(first, first + n)), SamplingParams(max_tokens=100, temperature=0),
                   arrival_time=t, priority=priority)


def run(s: Scheduler, out: SchedulerOutput, token: int = 1) -> None:
    """Finish a step the way the engine does: advance, then append a token to completing requests."""
    completing = [i.request for i in out.scheduled if i.completes]
    s.update_after_step(out)
    for r in completing:
        r.append_token(token, None, s.max_model_len)


def plan(out: SchedulerOutput) -> list[tuple[str, int]]:
    return [(i.request.request_id, i.num_new_tokens) for i in out.scheduled]


def test_chunked_prefill_then_decodes_go_first() -> None:
    s = make(budget=8)
    s.add(req("a", 12))
    s.add(req("b", 6, first=100))
    out = s.schedule()
    assert plan(out) == [("a", 8)]
    assert not out.scheduled[0].completes
    run(s, out)
    out = s.schedule()
    assert plan(out) == [("a", 4), ("b", 4)]
    run(s, out)
    assert len(s.running[0].output_token_ids) == 1
    out = s.schedule()
    assert plan(out) == [("a", 1), ("b", 2)]
    run(s, out)
    out = s.schedule()
    assert plan(out) == [("a", 1), ("b", 1)]
    s.kv.check_integrity()


def test_prefix_hit_skips_cached_blocks_but_runs_last_token() -> None:
    s = make(budget=64)
    a = req("a", 10)
    s.add(a)
    run(s, s.schedule())
    b = req("b", 10)
    s.add(b)
    out = s.schedule()
    assert plan(out) == [("a", 1), ("b", 2)]
    assert b.metrics.cached_prompt_tokens == 8
    assert s.kv.blocks_of("b")[:2] == s.kv.blocks_of("a")[:2]
    c = req("c", 8)
    s.add(c)
    out = s.schedule()
    # a fully cached 8-token prompt still computes its last block (its last token needs logits)
    assert ("c", 4) in plan(out)
    s.kv.check_integrity()


def test_max_num_seqs_limits_admission() -> None:
    s = make(budget=64, seqs=2)
    for i in range(3):
        s.add(req(f"r{i}", 4, first=10 * i))
    out = s.schedule()
    assert plan(out) == [("r0", 4), ("r1", 4)]
    assert [r.request_id for r in s.waiting] == ["r2"]


def test_preemption_picks_latest_lowest_priority_and_recomputes() -> None:
    s = make(kv_blocks=4, budget=64, block=4)
    a, b = req("a", 7, t=1.0), req("b", 7, first=50, t=2.0)
    s.add(a)
    s.add(b)
    run(s, s.schedule())
    assert len(a.output_token_ids) == len(b.output_token_ids) == 1
    run(s, s.schedule())
    # both now hold 8 tokens in 4 blocks; a's 9th token needs a fifth block
    out = s.schedule()
    assert [r.request_id for r in out.preempted] == ["b"]
    assert plan(out) == [("a", 1)]
    assert b.status is RequestStatus.WAITING and b.num_computed_tokens == 0
    assert b.output_token_ids == [1, 1]
    assert s.num_preemptions == 1 and b.metrics.num_preemptions == 1
    s.kv.check_integrity()


def test_high_priority_waits_ahead_and_is_preempted_last() -> None:
    s = make(budget=64)
    s.add(req("low", 4, priority=5, t=0.0))
    s.add(req("high", 4, first=20, priority=-1, t=1.0))
    assert [r.request_id for r in s.waiting] == ["high", "low"]
    s.schedule()
    assert s._preemption_victim().request_id == "low"


def test_finish_frees_everything() -> None:
    s = make()
    r = req("a", 9)
    s.add(r)
    run(s, s.schedule())
    s.finish(r)
    s.finish(r)
    assert s.kv.pool.num_used_blocks == 0
    s.kv.check_integrity()


def shared(rid: str, tail: list[int]) -> Request:
    """A request whose first 20 tokens (5 blocks of 4) are 0..19."""
    return Request(rid, list(range(20)) + tail, SamplingParams(max_tokens=100, temperature=0),
                   arrival_time=0.0)


def dedup(max_wait: int | None = None) -> Scheduler:
    return Scheduler(KVCacheManager(64, 4), 64, 4, max_model_len=64, prefix_wait_min_tokens=8,
                     max_prefix_wait_steps=max_wait)


def test_waiting_request_takes_in_flight_prefix_blocks_once_committed() -> None:
    s = dedup()
    a, b, c = shared("a", [50, 51, 52, 53]), shared("b", [90, 91, 92]), req("c", 4, first=200)
    for r in (a, b, c):
        s.add(r)
    out = s.schedule()
    # b's 5 full blocks are being computed by a: b waits, c behind it is not held up
    assert plan(out) == [("a", 24), ("c", 4)]
    assert [r.request_id for r in s.waiting] == ["b"]
    run(s, out)
    s.kv.check_integrity()
    out = s.schedule()
    assert plan(out) == [("a", 1), ("c", 1), ("b", 3)]
    assert b.metrics.cached_prompt_tokens == 20
    assert s.kv.blocks_of("b")[:5] == s.kv.blocks_of("a")[:5]
    run(s, out)
    s.kv.check_integrity()
    assert s.num_prefix_waits == 1 and s.inflight is not None and not s.inflight


def test_prefix_wait_is_bounded_and_thresholded_and_ends_with_its_source() -> None:
    s = dedup(max_wait=0)  # bound reached at once: b computes the prefix itself
    a, b = shared("a", [50]), shared("b", [90])
    s.add(a)
    s.add(b)
    assert plan(s.schedule()) == [("a", 21), ("b", 21)]
    assert b.metrics.cached_prompt_tokens == 0

    s = Scheduler(KVCacheManager(64, 4), 64, 4, max_model_len=64, prefix_wait_min_tokens=24)
    s.add(shared("a", [50]))
    s.add(shared("b", [90]))  # 20 shared tokens in flight < 24: no wait
    assert plan(s.schedule()) == [("a", 21), ("b", 21)]

    s = Scheduler(KVCacheManager(64, 4), 8, 4, max_model_len=64, prefix_wait_min_tokens=8)
    a, b = shared("a", [50]), shared("b", [90])
    s.add(a)
    out = s.schedule()
    assert plan(out) == [("a", 8)]
    run(s, out)
    s.add(b)
    s.max_num_batched_tokens = 64
    out = s.schedule()
    # a computes blocks 2-4 now: b's next uncached blocks are in flight, it waits
    assert plan(out) == [("a", 13)] and s.waiting[0] is b
    s.finish(a)  # its source aborted before committing: b no longer waits
    out = s.schedule()
    assert plan(out) == [("b", 13)] and b.metrics.cached_prompt_tokens == 8
    s.kv.check_integrity()

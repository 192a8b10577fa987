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

"""Searches over simulations: the smallest P:D meeting an SLO at a rate, and the highest rate a P:D holds.

``smallest_cluster`` assumes what the model makes true: more prefill workers never raise the TTFT p90,
more decode workers never raise the ITL p90. It finds the fewest prefill workers meeting the TTFT
bound with the most decode workers allowed, and the fewest decode workers meeting the ITL bound with
the most prefill workers (each by galloping up from a lower bound, then bisecting), then, when at
most ``EXHAUSTIVE_SPLITS`` splits remain, tries the totals from their sum upward, every split of a total
that respects both, and returns the first total with a split meeting both bounds (of its splits, the
one with the most slack); with more (large clusters) it walks from the two minima, adding a worker to
each role whose bound a run misses. Every simulation is cached by split; ``evaluations`` counts them.

``max_rate`` bisects the rate (to ``rel_tol``) between one that meets the SLO and one that does not.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from planner.profile import Profile, attended_pairs
from planner.results import SimResult
from planner.simulator import RequestSpec

Evaluate = Callable[[int, int], SimResult]  # (prefill workers, decode workers) -> one simulated run
EXHAUSTIVE_SPLITS = 64  # above this many candidate splits, walk from the minima instead of trying every one


@dataclass(frozen=True)
class SloBounds:
    ttft_p90_s: float
    itl_p90_s: float


@dataclass
class SearchOutcome:
    """The split found (None: no split within the limits meets the SLO) and every run tried."""

    best: tuple[int, int] | None
    result: SimResult | None
    tried: dict[tuple[int, int], SimResult] = field(default_factory=dict)
    wall_s: float = 0.0

    @property
    def evaluations(self) -> int:
        return len(self.tried)


def first_meeting(lo: int, hi: int, ok: Callable[[int], bool], start: int | None = None) -> int | None:
    """The least ``x`` in ``[lo, hi]`` with ``ok(x)`` for a monotone ``ok`` (None if ``ok(hi)`` fails):
    gallop up from ``start`` doubling the step, then bisect. ``start`` is a floor (values below it are
    taken to fail, e.g. a capacity bound); default ``lo``."""
    if start is not None:
        lo = max(lo, min(start, hi))
    if lo > hi:
        return None
    x = lo
    step = 1
    while not ok(x):
        if x >= hi:
            return None
        lo = x + 1
        x = min(x + step, hi)
        step *= 2
    hi = x
    while lo < hi:
        mid = (lo + hi) // 2
        if ok(mid):
            hi = mid
        else:
            lo = mid + 1
    return hi


def smallest_cluster(evaluate: Evaluate, slo: SloBounds, prefill: tuple[int, int], decode: tuple[int, int],
                     start: tuple[int, int] | None = None) -> SearchOutcome:
    """The fewest workers in all (then the most slack) within ``prefill``/``decode`` = (min, max) whose
    run meets ``slo``; ``start`` = lower bounds to gallop from (e.g. from ``capacity_bounds``)."""
    t0 = time.perf_counter()
    out = SearchOutcome(None, None)

    def run(p: int, d: int) -> SimResult:
        if (p, d) not in out.tried:
            out.tried[(p, d)] = evaluate(p, d)
        return out.tried[(p, d)]

    def done_ok(r: SimResult) -> bool:
        return r.completed == r.requests

    p_lo, p_hi = prefill
    d_lo, d_hi = decode
    sp, sd = start if start is not None else (p_lo, d_lo)
    p_need = first_meeting(p_lo, p_hi, lambda p: done_ok(r := run(p, d_hi)) and r.ttft.p90 <= slo.ttft_p90_s,
                           sp)
    d_need = None
    if p_need is not None:
        d_need = first_meeting(d_lo, d_hi, lambda d: done_ok(r := run(p_hi, d))
                               and not r.itl.p90 > slo.itl_p90_s, sd)
    if p_need is not None and d_need is not None:
        if (p_hi - p_need + 1) * (d_hi - d_need + 1) <= EXHAUSTIVE_SPLITS:
            _every_split(run, slo, out, (p_need, p_hi), (d_need, d_hi))
        else:
            _walk(run, slo, out, (p_need, p_hi), (d_need, d_hi))
    out.wall_s = time.perf_counter() - t0
    return out


def _every_split(run: Evaluate, slo: SloBounds, out: SearchOutcome, prefill: tuple[int, int],
                 decode: tuple[int, int]) -> None:
    """Totals from the least upward, every split of each: the first total with a split meeting both."""
    (p_need, p_hi), (d_need, d_hi) = prefill, decode
    for total in range(p_need + d_need, p_hi + d_hi + 1):
        splits = [(p, total - p) for p in range(p_need, p_hi + 1) if d_need <= total - p <= d_hi]
        meeting = [(p, d) for p, d in splits if run(p, d).meets(slo.ttft_p90_s, slo.itl_p90_s)]
        if meeting:
            best = min(meeting, key=lambda s: (run(*s).slack(slo.ttft_p90_s, slo.itl_p90_s), s))
            out.best, out.result = best, run(*best)
            return


def _walk(run: Evaluate, slo: SloBounds, out: SearchOutcome, prefill: tuple[int, int],
          decode: tuple[int, int]) -> None:
    """From both minima, add a worker to each role whose bound the run misses, until both are met."""
    (p, p_hi), (d, d_hi) = prefill, decode
    while p <= p_hi and d <= d_hi:
        r = run(p, d)
        if r.meets(slo.ttft_p90_s, slo.itl_p90_s):
            out.best, out.result = (p, d), r
            return
        ttft_bad = r.completed < r.requests or not r.ttft.p90 <= slo.ttft_p90_s
        itl_bad = r.itl.p90 > slo.itl_p90_s
        p += 1 if ttft_bad else 0
        d += 1 if itl_bad else 0


def capacity_bounds(profile: Profile, specs: Sequence[RequestSpec], rate: float,
                    slo: SloBounds) -> tuple[int, int]:
    """Lower bounds on the workers of each role at ``rate`` req/s of ``specs``' lengths, from capacity
    alone (the searches gallop up from them). Prefill: the prompt work per second (every prefix hit
    taken, the step base shared away) over one worker's second. Decode: tokens per second over the
    most one worker makes with steps no longer than the ITL bound (batch limited by ``max_num_seqs``
    and by the KV a request holds at mid-output); a bound no batch meets gives a large number."""
    n = max(len(specs), 1)
    bs = profile.model.block_size
    work = sum(profile.prefill.per_token_s * (s.input_tokens - _hit(s, bs))
               + profile.prefill.per_attended_s * attended_pairs(s.input_tokens - _hit(s, bs), _hit(s, bs))
               for s in specs) / n
    p_lb = max(1, math.ceil(rate * work))
    mean_in = sum(s.input_tokens for s in specs) / n
    mean_out = sum(s.output_tokens for s in specs) / n
    ctx = mean_in + mean_out / 2
    dc = profile.decode
    batch = (slo.itl_p90_s - dc.base_s) / max(dc.per_seq_s + dc.per_context_s * ctx, 1e-12)
    batch = min(batch, profile.model.max_num_seqs, profile.model.kv_capacity_tokens / (mean_in + mean_out))
    if batch < 1:
        return p_lb, 10**6
    per_worker = batch / dc.step_s(int(batch), int(batch * ctx))
    return p_lb, max(1, math.ceil(rate * mean_out / per_worker))


def _hit(s: RequestSpec, block_size: int) -> int:
    if s.prefix_id < 0:
        return 0
    return min(s.prefix_tokens, s.input_tokens - 1) // block_size * block_size


def max_rate(evaluate_at: Callable[[float], SimResult], slo: SloBounds, start: float,
             rel_tol: float = 0.02, limit: float = 1e7) -> tuple[float, SimResult | None]:
    """The highest rate (req/s, to ``rel_tol``) at which ``evaluate_at(rate)`` meets ``slo``, galloping
    from ``start`` by doubling or halving; (0.0, None) when even ``start / 1024`` fails."""
    good: tuple[float, SimResult] | None = None
    bad = math.inf
    rate = start
    for _ in range(40):
        r = evaluate_at(rate)
        if r.meets(slo.ttft_p90_s, slo.itl_p90_s):
            good = (rate, r)
            if math.isinf(bad):
                if rate * 2 > limit:
                    return rate, r
                rate *= 2
                continue
        else:
            bad = rate
            if good is None:
                if rate < start / 1024:
                    return 0.0, None
                rate /= 2
                continue
        if bad - good[0] <= rel_tol * good[0]:
            break
        rate = (good[0] + bad) / 2
    return (good[0], good[1]) if good is not None else (0.0, None)

"""How many prefill and decode workers a live load needs: the planner's one question to the simulator.

Contract with the live planner (``cluster/``), stable: ``recommend(profile, load, slo, bounds, seed=0)``
returns the smallest total worker count within ``bounds`` (then the split with the most slack) whose
simulated TTFT p90 and ITL p90 meet ``slo`` under ``load``; when no split within the bounds does, the
maximum bounds, with a reason saying so. It simulates the load as Poisson arrivals of requests of the
mean lengths, every request sharing ``prefix_hit_rate`` of its prompt as one prefix (so a worker that
served one serves that much of the next from its cache), for ``RUN_SECONDS`` of arrivals (at least
``MIN_REQUESTS``, at most ``MAX_REQUESTS``), the first ``WARMUP_FRACTION`` of them not measured. The
simulator needs at least one worker of each role: bounds below 1 are raised to 1. It returns in well
under a second for bounds up to 8 workers per role (a few dozen short simulations at most).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from planner.arrivals import uniform_requests
from planner.profile import Profile
from planner.results import SimResult
from planner.search import SloBounds, smallest_cluster
from planner.simulator import Cluster, simulate

RUN_SECONDS = 60.0
MIN_REQUESTS = 80
MAX_REQUESTS = 240
WARMUP_FRACTION = 0.1


@dataclass(frozen=True)
class Slo:
    ttft_p90_s: float
    itl_p90_s: float

    def __post_init__(self) -> None:
        if not (self.ttft_p90_s > 0 and self.itl_p90_s > 0):
            raise ValueError(f"--slo: ttft and itl must be > 0, got ttft={self.ttft_p90_s}, "
                             f"itl={self.itl_p90_s}")


@dataclass(frozen=True)
class Bounds:
    min_prefill: int
    max_prefill: int
    min_decode: int
    max_decode: int

    def __post_init__(self) -> None:
        if self.min_prefill > self.max_prefill:
            raise ValueError(f"--min-prefill ({self.min_prefill}) is above --max-prefill "
                             f"({self.max_prefill})")
        if self.min_decode > self.max_decode:
            raise ValueError(f"--min-decode ({self.min_decode}) is above --max-decode ({self.max_decode})")
        if self.max_prefill < 1 or self.max_decode < 1:
            raise ValueError("--max-prefill and --max-decode must be >= 1")


@dataclass(frozen=True)
class LiveLoad:
    rate_rps: float
    mean_input_tokens: float
    mean_output_tokens: float
    prefix_hit_rate: float


@dataclass(frozen=True)
class Recommendation:
    num_prefill: int
    num_decode: int
    reason: str
    predicted_ttft_p90_s: float
    predicted_itl_p90_s: float


def _fmt(slo: Slo, ttft: float, itl: float) -> str:
    return (f"simulated TTFT p90 {ttft:.3f} s (SLO {slo.ttft_p90_s:g} s), "
            f"ITL p90 {itl * 1000:.1f} ms (SLO {slo.itl_p90_s * 1000:g} ms)")


def recommend(profile: Profile, load: LiveLoad, slo: Slo, bounds: Bounds, *, seed: int = 0) -> Recommendation:
    """See the module docstring."""
    p_lo, p_hi = max(bounds.min_prefill, 1), max(bounds.max_prefill, 1)
    d_lo, d_hi = max(bounds.min_decode, 1), max(bounds.max_decode, 1)
    if not load.rate_rps > 0:
        return Recommendation(p_lo, d_lo, "no load: the minimum bounds", 0.0, 0.0)
    n_in = max(1, round(load.mean_input_tokens))
    n_out = max(1, round(load.mean_output_tokens))
    hit = min(max(load.prefix_hit_rate, 0.0), 1.0)
    n = int(min(MAX_REQUESTS, max(MIN_REQUESTS, load.rate_rps * RUN_SECONDS)))
    specs = uniform_requests(load.rate_rps, n, n_in, n_out, round(hit * n_in), seed)
    warmup = specs[int(n * WARMUP_FRACTION)].arrival_s

    def evaluate(p: int, d: int) -> SimResult:
        return simulate(profile, Cluster(p, d), specs, warmup_s=warmup)

    bounds_slo = SloBounds(slo.ttft_p90_s, slo.itl_p90_s)
    found = smallest_cluster(evaluate, bounds_slo, (p_lo, p_hi), (d_lo, d_hi))
    at = f"at {load.rate_rps:.3g} req/s of {n_in} -> {n_out} tokens ({hit:.0%} prefix hits)"
    if found.best is not None and found.result is not None:
        p, d = found.best
        r = found.result
        return Recommendation(p, d, f"{p}P:{d}D is the smallest cluster meeting the SLO {at}: "
                              f"{_fmt(slo, r.ttft.p90, r.itl.p90)}", r.ttft.p90, r.itl.p90)
    r = found.tried.get((p_hi, d_hi)) or evaluate(p_hi, d_hi)
    ttft = r.ttft.p90 if math.isfinite(r.ttft.p90) else math.inf
    return Recommendation(p_hi, d_hi, f"no split within the bounds meets the SLO {at}; the maximum "
                          f"{p_hi}P:{d_hi}D gives {_fmt(slo, ttft, r.itl.p90)}", ttft, r.itl.p90)

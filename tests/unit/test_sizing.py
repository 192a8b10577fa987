"""Searches over the simulator and the planner's ``recommend``: monotone, minimal, fast, explained."""

from __future__ import annotations

from typing import Any

import pytest

from planner import sizing
from planner.arrivals import uniform_requests
from planner.profile import DecodeCost, PrefillCost, Profile
from planner.results import SimResult
from planner.search import SloBounds, capacity_bounds, first_meeting, max_rate, smallest_cluster
from planner.simulator import Cluster, RequestSpec, simulate
from planner.sizing import Bounds, LiveLoad, Recommendation, Slo, recommend
from tests.unit.test_simulator import make_profile

# prefill 10 ms + 1 ms/token: a 200-token prompt takes 0.21 s; decode 20 ms + 2 ms per running request
PROFILE = make_profile(prefill=PrefillCost(0.01, 0.001, 0.0), decode=DecodeCost(0.02, 0.002, 0.0))
SLO = Slo(ttft_p90_s=1.0, itl_p90_s=0.05)


def test_first_meeting_finds_the_least_passing_value() -> None:
    calls: list[int] = []

    def ok(x: int) -> bool:
        calls.append(x)
        return x >= 37

    assert first_meeting(1, 100, ok) == 37
    assert len(calls) <= 14
    assert first_meeting(1, 30, lambda x: x >= 37) is None
    assert first_meeting(40, 100, lambda x: x >= 37) == 40
    assert first_meeting(1, 100, lambda x: x >= 37, start=30) == 37
    assert first_meeting(1, 100, lambda x: x >= 37, start=50) == 50  # a floor: below it is taken to fail


def test_smallest_cluster_is_minimal_and_meets_the_slo() -> None:
    specs = uniform_requests(8.0, 200, 200, 20, 0)

    def evaluate(p: int, d: int) -> SimResult:
        return simulate(PROFILE, Cluster(p, d), specs)

    slo = SloBounds(1.0, 0.05)
    found = smallest_cluster(evaluate, slo, (1, 8), (1, 8))
    assert found.best is not None and found.result is not None
    p, d = found.best
    assert found.result.meets(1.0, 0.05)
    # 8 req/s x 0.21 s of prefill is 1.7 workers' time: at least 2; every split of one worker fewer fails
    assert p >= 2
    for q in range(1, p + d - 1):
        assert not evaluate(q, p + d - 1 - q).meets(1.0, 0.05)


def test_more_load_never_needs_fewer_workers() -> None:
    totals = []
    for rate in (1.0, 4.0, 8.0, 12.0):
        specs = uniform_requests(rate, 200, 200, 20, 0)
        def evaluate(p: int, d: int, s: list[RequestSpec] = specs) -> SimResult:
            return simulate(PROFILE, Cluster(p, d), s)

        found = smallest_cluster(evaluate, SloBounds(1.0, 0.05), (1, 8), (1, 8))
        assert found.best is not None
        totals.append(sum(found.best))
    assert totals == sorted(totals) and totals[0] < totals[-1]


def test_capacity_bounds_are_below_what_the_search_finds() -> None:
    specs = uniform_requests(8.0, 200, 200, 20, 0)
    p_lb, d_lb = capacity_bounds(PROFILE, specs, 8.0, SloBounds(1.0, 0.05))
    assert p_lb == 2  # ceil(8 x 200 x 1 ms)
    assert d_lb == 1  # 15 requests fit a 50 ms step (20 + 2 x 15); 300 tokens/s a worker > 160 needed
    found = smallest_cluster(lambda p, d: simulate(PROFILE, Cluster(p, d), specs), SloBounds(1.0, 0.05),
                             (1, 8), (1, 8), start=(p_lb, d_lb))
    assert found.best is not None and found.best[0] >= p_lb and found.best[1] >= d_lb


def test_max_rate_brackets_the_slo() -> None:
    def at(rate: float) -> SimResult:
        return simulate(PROFILE, Cluster(1, 1), uniform_requests(rate, 150, 200, 20, 0))

    rate, result = max_rate(at, SloBounds(1.0, 0.05), 1.0)
    assert result is not None and result.meets(1.0, 0.05)
    assert 1.0 < rate < 1 / 0.21  # one prefill worker's capacity
    assert not at(rate * 1.1).meets(1.0, 0.05)


def test_recommend_sizes_a_load_within_bounds_with_a_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    """... and cheaply, as the live planner runs it every interval: a few simulated clusters (a search,
    not every split of the 8 x 8 bounds), each of at most ``MAX_REQUESTS`` requests. Counted, not
    timed, so a loaded machine does not flip it."""
    runs: list[tuple[int, int, int]] = []

    def counted(profile: Profile, cluster: Cluster, specs: list[RequestSpec], **kwargs: Any) -> SimResult:
        runs.append((cluster.num_prefill, cluster.num_decode, len(specs)))
        return simulate(profile, cluster, specs, **kwargs)

    monkeypatch.setattr(sizing, "simulate", counted)
    rec = recommend(PROFILE, LiveLoad(8.0, 200, 20, 0.0), SLO, Bounds(1, 8, 1, 8))
    assert isinstance(rec, Recommendation)
    assert 2 <= rec.num_prefill <= 8 and 1 <= rec.num_decode <= 8
    assert "smallest cluster meeting the SLO" in rec.reason
    assert rec.predicted_ttft_p90_s <= 1.0 and rec.predicted_itl_p90_s <= 0.05
    assert 1 <= len(runs) <= 8 and all(n <= sizing.MAX_REQUESTS for _, _, n in runs), runs
    assert (rec.num_prefill, rec.num_decode) in {(p, d) for p, d, _ in runs}


def test_recommend_more_load_more_workers_and_prefix_hits_fewer_prefill() -> None:
    low = recommend(PROFILE, LiveLoad(2.0, 200, 20, 0.0), SLO, Bounds(1, 8, 1, 8))
    high = recommend(PROFILE, LiveLoad(12.0, 200, 20, 0.0), SLO, Bounds(1, 8, 1, 8))
    cached = recommend(PROFILE, LiveLoad(12.0, 200, 20, 0.75), SLO, Bounds(1, 8, 1, 8))
    assert low.num_prefill + low.num_decode < high.num_prefill + high.num_decode
    assert cached.num_prefill < high.num_prefill


def test_recommend_says_when_the_bounds_are_too_small() -> None:
    rec = recommend(PROFILE, LiveLoad(40.0, 200, 20, 0.0), SLO, Bounds(1, 2, 1, 2))
    assert (rec.num_prefill, rec.num_decode) == (2, 2)
    assert rec.reason.startswith("no split within the bounds meets the SLO")
    assert rec.predicted_ttft_p90_s > 1.0


def test_recommend_without_load_keeps_the_minimum() -> None:
    rec = recommend(PROFILE, LiveLoad(0.0, 0, 0, 0.0), SLO, Bounds(1, 4, 2, 4))
    assert (rec.num_prefill, rec.num_decode) == (1, 2)


def test_bad_bounds_and_slo_name_the_flag() -> None:
    with pytest.raises(ValueError, match="--min-prefill"):
        Bounds(3, 2, 1, 1)
    with pytest.raises(ValueError, match="--min-decode"):
        Bounds(1, 2, 5, 4)
    with pytest.raises(ValueError, match="--slo"):
        Slo(0.0, 0.05)

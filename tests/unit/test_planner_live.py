"""The live planner's rule over the real simulator (``planner.sizing.recommend``) and a profile measured on
this machine (the one the planner integration test serves with): what a measured SLO breach adds, the
hysteresis before any change, the floor a breach leaves, and scaling down once the load has fallen."""

from __future__ import annotations

from pathlib import Path

import pytest

from cluster.config import PlannerOptions
from cluster.planning import make_planner
from planner.live import LivePlanner, Observed, p90
from planner.profile import load_profile
from planner.sizing import Bounds, Slo

PROFILE = Path(__file__).resolve().parents[1] / "data" / "planner_profile.json"
SLO = Slo(ttft_p90_s=1.0, itl_p90_s=0.5)


def planner() -> LivePlanner:
    return LivePlanner(load_profile(PROFILE), SLO, Bounds(min_prefill=1, max_prefill=1, min_decode=1,
                                                          max_decode=2), hysteresis=2)


def seen(rate: float, num_decode: int, ttft: float | None = None, waiting: int = 0,
         itl: float | None = None) -> Observed:
    return Observed(seconds=10.0, requests=round(rate * 10), mean_input_tokens=40.0, mean_output_tokens=40.0,
                    prefix_hit_rate=0.5, ttft_p90_s=ttft, itl_p90_s=itl, decode_waiting=waiting,
                    decode_kv_usage=0.1, num_prefill=1, num_decode=num_decode)


def test_p90_is_the_nearest_rank_and_needs_samples() -> None:
    assert p90([float(i) for i in range(1, 11)], 5) == 9.0
    assert p90([3.0, 1.0, 2.0], 5) is None
    assert p90([0.5] * 5, 5) == 0.5


def test_no_load_holds_at_the_minimum() -> None:
    d = planner().decide(seen(0.0, 1))
    assert (d.action, d.code, d.target_prefill, d.target_decode) == ("hold", "steady", 1, 1)


def test_breach_adds_decode_after_hysteresis_and_keeps_it_until_load_falls() -> None:
    p = planner()
    slow = seen(0.3, 1, ttft=2.5, waiting=2)
    first, second = p.decide(slow), p.decide(slow)
    assert (first.action, first.code, first.target_decode) == ("hold", "hysteresis", 2)
    assert (second.action, second.role, second.code) == ("add", "decode", "ttft_slo")
    assert "TTFT p90 2.50 s > SLO 1.00 s with 2 waiting for a decode slot" in second.reason
    p.reset()
    for _ in range(3):  # the SLO met at the same load: the floor keeps the second decode worker
        kept = p.decide(seen(0.3, 2, ttft=0.3))
        assert (kept.action, kept.target_decode) == ("hold", 2), kept.reason
        assert "keeping 2 decode" in kept.reason
    fallen = seen(0.1, 2, ttft=0.2)  # below 3/4 of the rate the SLO broke at: the floor goes
    first, second = p.decide(fallen), p.decide(fallen)
    assert (first.action, first.code, first.target_decode) == ("hold", "hysteresis", 1)
    assert (second.action, second.role, second.code) == ("remove", "decode", "scale")


def test_itl_breach_points_at_decode_and_bounds_hold() -> None:
    p = planner()
    for _ in range(2):
        d = p.decide(seen(0.3, 2, itl=0.9))
    assert (d.action, d.code, d.target_decode) == ("hold", "steady", 2)  # at --max-decode already


def test_unreadable_profile_names_the_flag() -> None:
    with pytest.raises(ValueError, match="--planner-profile /nonexistent/profile.json: "):
        make_planner(PlannerOptions(enabled=True, profile="/nonexistent/profile.json"), 1, 1)


@pytest.mark.parametrize("hysteresis", [0, -1])
def test_hysteresis_must_be_positive(hysteresis: int) -> None:
    with pytest.raises(ValueError, match="--planner-hysteresis"):
        LivePlanner(load_profile(PROFILE), SLO, Bounds(1, 1, 1, 1), hysteresis=hysteresis)

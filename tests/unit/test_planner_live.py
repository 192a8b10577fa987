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
SLO = Slo(ttft_p90_s=2.0, itl_p90_s=0.125)


def planner() -> LivePlanner:
    return LivePlanner(load_profile(PROFILE), SLO, Bounds(min_prefill=1, max_prefill=1, min_decode=1,
                                                          max_decode=2), hysteresis=2)


def seen(rate: float, num_decode: int, ttft: float | None = None, waiting: int = 0,
         itl: float | None = None) -> Observed:
    return Observed(seconds=20.0, requests=round(rate * 20), mean_input_tokens=45.0, mean_output_tokens=24.0,
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
    slow = seen(0.4, 1, ttft=0.3, itl=0.3)  # requests wait for the one decode slot after their first token
    first, second = p.decide(slow), p.decide(slow)
    assert (first.action, first.code, first.target_decode) == ("hold", "hysteresis", 2)
    assert (second.action, second.role, second.code) == ("add", "decode", "itl_slo")
    assert second.reason.startswith("ITL p90 300 ms > SLO 125 ms; simulator at 0.40 req/s: 1P:1D")
    p.reset()
    for rate in (0.8, 0.8, 0.65):  # the SLO met, the larger split carrying more: the floor holds
        kept = p.decide(seen(rate, 2, ttft=0.3, itl=0.08))
        assert (kept.action, kept.code, kept.target_decode) == ("hold", "steady", 2), kept.reason
        assert "keeping 2 decode (the SLO broke with fewer) while the rate stays above 0.48 req/s" \
            in kept.reason
    fallen = seen(0.4, 2, ttft=0.2, itl=0.07)  # below 3/5 of the most it carried: the floor goes
    first, second = p.decide(fallen), p.decide(fallen)
    assert (first.action, first.code, first.target_decode) == ("hold", "hysteresis", 1)
    assert (second.action, second.role, second.code) == ("remove", "decode", "scale")


def test_ttft_breach_points_at_prefill_unless_requests_wait_for_decode() -> None:
    p = LivePlanner(load_profile(PROFILE), SLO, Bounds(1, 2, 1, 2), hysteresis=1)
    d = p.decide(seen(0.3, 1, ttft=3.0))
    assert (d.action, d.role, d.code) == ("add", "prefill", "ttft_slo")
    p.reset()
    d = p.decide(seen(0.3, 1, ttft=3.0, waiting=3))
    assert (d.action, d.role, d.code) == ("add", "decode", "ttft_slo")


def test_itl_breach_points_at_decode_and_bounds_hold() -> None:
    p = planner()
    for _ in range(2):
        d = p.decide(seen(0.3, 2, itl=0.9))  # one more decode worker would help, but --max-decode is 2
    assert (d.action, d.code, d.target_decode) == ("hold", "steady", 2)  # at --max-decode already


def test_unreadable_profile_names_the_flag() -> None:
    with pytest.raises(ValueError, match="--planner-profile /nonexistent/profile.json: "):
        make_planner(PlannerOptions(enabled=True, profile="/nonexistent/profile.json"), 1, 1)


@pytest.mark.parametrize("hysteresis", [0, -1])
def test_hysteresis_must_be_positive(hysteresis: int) -> None:
    with pytest.raises(ValueError, match="--planner-hysteresis"):
        LivePlanner(load_profile(PROFILE), SLO, Bounds(1, 1, 1, 1), hysteresis=hysteresis)

"""The live planner's rule: what one interval's measurements say to do with the P:D split.

``LivePlanner.decide(observed)`` turns one interval's ``Observed`` (the load and latencies the router
measured, the workers' queues and KV use, the current worker counts) into one ``Decision``:

1. Target. The observed load (request rate, mean prompt and output tokens, prefix hit rate) goes to
   the simulator (``planner.sizing.recommend``) with the live profile, the SLO and the bounds: the
   smallest P:D split it predicts meets the SLO.
2. Feedback. When the measured TTFT or ITL p90 breaks the SLO (over at least ``min_samples``
   samples) and the target adds no worker of the role the breach points at, that role gets one more,
   within the bounds: a TTFT breach with requests waiting for a decode slot, an ITL breach, or decode
   KV use above ``kv_high`` points at decode; any other TTFT breach at prefill. The profile may be
   off for this machine or load; the measurement is not. Likewise the target never removes a worker
   of a role while the SLO is broken, and a count a breach called for is kept (a floor) until the
   request rate falls below ``release`` times the highest rate seen since (a closed-loop load shows
   its demand only once it is served), so the simulator's lower target does not take back at once
   what the measurement showed was needed.
3. Hysteresis. A change is made only once the same target has come ``hysteresis`` intervals in a
   row, and one worker at a time: the role furthest below its target is added (decode first on a
   tie), else the role furthest above is drained and removed. Anything else holds.

Every ``Decision`` carries its action (``add``, ``remove``, ``hold``), the role, the target, a short
``code`` (a metric label: ``scale``, ``ttft_slo``, ``itl_slo``, ``kv``, ``steady``, ``hysteresis``)
and a sentence saying why. Nothing here touches Ray or the router
(``cluster.planning`` does); it is plain code over numbers, tested alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from planner.profile import Profile
from planner.sizing import Bounds, LiveLoad, Slo, recommend

ROLES = ("decode", "prefill")


@dataclass(frozen=True)
class Observed:
    """One interval as the router saw it. Latency p90s are ``None`` under ``min_samples`` samples."""

    seconds: float
    requests: int
    mean_input_tokens: float
    mean_output_tokens: float
    prefix_hit_rate: float
    ttft_p90_s: float | None
    itl_p90_s: float | None
    decode_waiting: int  # requests waiting for a batch slot on the decode workers
    decode_kv_usage: float  # the fullest decode worker's share of KV blocks in use (0..1)
    num_prefill: int
    num_decode: int

    @property
    def rate_rps(self) -> float:
        return self.requests / self.seconds if self.seconds > 0 else 0.0


@dataclass(frozen=True)
class Decision:
    action: str  # "add", "remove" or "hold"
    role: str | None  # the role added or removed; None on hold
    target_prefill: int
    target_decode: int
    code: str
    reason: str
    predicted_ttft_p90_s: float | None = None
    predicted_itl_p90_s: float | None = None


def p90(samples: list[float], min_samples: int) -> float | None:
    """The 90th percentile (nearest rank) of ``samples``; None with fewer than ``min_samples``."""
    if len(samples) < max(1, min_samples):
        return None
    ordered = sorted(samples)
    return ordered[max(0, math.ceil(0.9 * len(ordered)) - 1)]


class LivePlanner:
    def __init__(self, profile: Profile, slo: Slo, bounds: Bounds, hysteresis: int = 2,
                 kv_high: float = 0.9, release: float = 0.6) -> None:
        if hysteresis < 1:
            raise ValueError("--planner-hysteresis must be >= 1")
        self.profile = profile
        self.slo = slo
        self.bounds = bounds
        self.hysteresis = hysteresis
        self.kv_high = kv_high
        self.release = release
        self._last_target: tuple[int, int] | None = None
        self._streak = 0
        self._floors: dict[str, tuple[int, float]] = {}  # role -> (count a breach called for, its rate)

    def decide(self, observed: Observed) -> Decision:
        if observed.requests == 0 and observed.ttft_p90_s is None and observed.itl_p90_s is None:
            load = LiveLoad(rate_rps=0.0, mean_input_tokens=0.0, mean_output_tokens=0.0, prefix_hit_rate=0.0)
        else:
            load = LiveLoad(rate_rps=observed.rate_rps, mean_input_tokens=observed.mean_input_tokens,
                            mean_output_tokens=observed.mean_output_tokens,
                            prefix_hit_rate=observed.prefix_hit_rate)
        rec = recommend(self.profile, load, self.slo, self.bounds)
        target = {r: self._clamp(r, n) for r, n in (("prefill", rec.num_prefill), ("decode", rec.num_decode))}
        code, why = "scale", f"simulator at {load.rate_rps:.2f} req/s: {rec.reason}"
        current = {"prefill": observed.num_prefill, "decode": observed.num_decode}
        breach = self._breach(observed)
        if breach is not None:
            role, code, what = breach
            for r in ROLES:  # never shrink a role while the SLO is broken
                target[r] = max(target[r], current[r])
            if target[role] <= current[role]:
                target[role] = self._clamp(role, current[role] + 1)
            self._floors[role] = (target[role], observed.rate_rps)
            why = f"{what}; {why}"
        for role, (floor, rate) in list(self._floors.items()):
            if observed.rate_rps < self.release * rate:
                del self._floors[role]
                continue
            rate = max(rate, observed.rate_rps)  # what the larger split carried: a closed loop's load
            self._floors[role] = (floor, rate)   # shows its demand only once served
            if target[role] < floor:
                target[role] = floor
                why = (f"{why}; keeping {floor} {role} (the SLO broke with fewer) while the rate stays "
                       f"above {self.release * rate:.2f} req/s")
        target_key = (target["prefill"], target["decode"])
        self._streak = self._streak + 1 if target_key == self._last_target else 1
        self._last_target = target_key

        def decision(action: str, role: str | None, code: str, reason: str) -> Decision:
            return Decision(action, role, target["prefill"], target["decode"], code, reason,
                            rec.predicted_ttft_p90_s, rec.predicted_itl_p90_s)

        gaps = {r: target[r] - current[r] for r in ROLES}
        if all(g == 0 for g in gaps.values()):
            return decision("hold", None, "steady", f"at target {target_key[0]}P:{target_key[1]}D; {why}")
        if self._streak < self.hysteresis:
            return decision("hold", None, "hysteresis",
                            f"target {target_key[0]}P:{target_key[1]}D seen {self._streak} of "
                            f"{self.hysteresis} intervals; {why}")
        grow = [r for r in ROLES if gaps[r] > 0]
        if grow:
            role = max(grow, key=lambda r: (gaps[r] / max(current[r], 1), r == "decode"))
            return decision("add", role, code, why)
        role = min(ROLES, key=lambda r: (gaps[r] / max(current[r], 1), r == "prefill"))
        return decision("remove", role, code, why)

    def reset(self) -> None:
        """Forget the target streak (after a change, the next target must hold anew)."""
        self._last_target, self._streak = None, 0

    def _clamp(self, role: str, n: int) -> int:
        b = self.bounds
        low, high = (b.min_prefill, b.max_prefill) if role == "prefill" else (b.min_decode, b.max_decode)
        return min(max(n, low), high)

    def _breach(self, o: Observed) -> tuple[str, str, str] | None:
        """The role a broken SLO points at, the reason code and a sentence; None when the SLO holds."""
        slo = self.slo
        if o.itl_p90_s is not None and o.itl_p90_s > slo.itl_p90_s:
            what = f"ITL p90 {o.itl_p90_s * 1e3:.0f} ms > SLO {slo.itl_p90_s * 1e3:.0f} ms"
            return "decode", "itl_slo", what
        if o.decode_kv_usage > self.kv_high:
            return "decode", "kv", f"decode KV {o.decode_kv_usage:.0%} used > {self.kv_high:.0%}"
        if o.ttft_p90_s is not None and o.ttft_p90_s > slo.ttft_p90_s:
            what = f"TTFT p90 {o.ttft_p90_s:.2f} s > SLO {slo.ttft_p90_s:.2f} s"
            if o.decode_waiting > 0:
                return "decode", "ttft_slo", f"{what} with {o.decode_waiting} waiting for a decode slot"
            return "prefill", "ttft_slo", what
        return None

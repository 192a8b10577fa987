"""What one simulation reports: latency percentiles, throughput, goodput and utilisation.

Percentiles are linear-interpolated (numpy's default, as ``bench.stats.percentile``). TTFT, ITL and E2E
follow ``pdserve bench``'s definitions: ITL pools every gap between two tokens of a request (the
simulator keeps them as (gap, how many requests saw it) pairs, ``weighted_percentile`` reads those as
if expanded), and a request meets the SLO when its TTFT and its mean ITL are within bounds. A request
that never got its first token before the simulation stopped counts with an infinite TTFT.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

QUANTILES = (50, 90, 99)


@dataclass(frozen=True)
class Percentiles:
    mean: float
    p50: float
    p90: float
    p99: float

    @staticmethod
    def of(values: np.ndarray) -> Percentiles:
        if values.size == 0:
            return Percentiles(math.nan, math.nan, math.nan, math.nan)
        finite = bool(np.isfinite(values).all())
        # with infinities, interpolation between two of them is NaN: take the higher neighbour instead
        p = np.percentile(values, QUANTILES) if finite else np.percentile(values, QUANTILES, method="higher")
        mean = float(values.mean()) if finite else math.inf
        return Percentiles(mean, float(p[0]), float(p[1]), float(p[2]))

    @staticmethod
    def weighted(values: np.ndarray, weights: np.ndarray) -> Percentiles:
        total = float(weights.sum()) if weights.size else 0.0
        if total <= 0:
            return Percentiles(math.nan, math.nan, math.nan, math.nan)
        order = np.argsort(values, kind="stable")
        v, w = values[order], weights[order]
        mean = float((v * w).sum() / total)
        p = [weighted_percentile(v, w, q, sorted_=True) for q in QUANTILES]
        return Percentiles(mean, p[0], p[1], p[2])


def weighted_percentile(values: np.ndarray, weights: np.ndarray, q: float, sorted_: bool = False) -> float:
    """The ``q``-th percentile of ``values[i]`` repeated ``weights[i]`` times (weights may be fractional:
    the positions are read off the cumulative weight), linear-interpolated between neighbours."""
    if not sorted_:
        order = np.argsort(values, kind="stable")
        values, weights = values[order], weights[order]
    cum = np.cumsum(weights)
    pos = (cum[-1] - 1) * q / 100.0
    lo = math.floor(pos)
    i_lo = min(int(np.searchsorted(cum, lo, side="right")), len(values) - 1)
    i_hi = min(int(np.searchsorted(cum, lo + 1, side="right")), len(values) - 1)
    return float(values[i_lo] + (values[i_hi] - values[i_lo]) * (pos - lo))


@dataclass(frozen=True)
class SimResult:
    """One simulated run. Times in seconds. Requests sent during the warm-up are left out of every figure;
    ``duration_s`` runs from the first measured send to the last measured end (throughputs are over it);
    utilisation is busy time over the whole run (warm-up included), per role; the mean decode batch is
    over the measured steps. The stretches (a shared host) are each role's stepping wall time over
    the same steps' costs at full speed, over the whole run: 1 when no host is shared; the CPU
    stretches the same with CPU time (contention's part), and ``wait_stretch`` wall over CPU time, every
    worker pooled (the wait for a core's part)."""

    num_prefill: int
    num_decode: int
    requests: int
    completed: int
    duration_s: float
    ttft: Percentiles
    itl: Percentiles
    e2e: Percentiles
    request_throughput: float
    output_throughput: float
    goodput: float
    slo_attainment: float
    prefill_utilisation: float
    decode_utilisation: float
    mean_decode_batch: float
    events: int
    wall_s: float
    prefill_stretch: float = 1.0
    decode_stretch: float = 1.0
    prefill_cpu_stretch: float = 1.0
    decode_cpu_stretch: float = 1.0
    wait_stretch: float = 1.0

    def meets(self, ttft_p90_s: float, itl_p90_s: float) -> bool:
        """Every request finished, and the p90s are within the bounds."""
        itl_ok = math.isnan(self.itl.p90) or self.itl.p90 <= itl_p90_s  # NaN: no request had 2 tokens
        return self.completed == self.requests and self.ttft.p90 <= ttft_p90_s and itl_ok

    def slack(self, ttft_p90_s: float, itl_p90_s: float) -> float:
        """The larger of the two p90s as a fraction of its bound (< 1 meets both)."""
        itl = 0.0 if math.isnan(self.itl.p90) else self.itl.p90
        return max(self.ttft.p90 / ttft_p90_s, itl / itl_p90_s)

    def as_dict(self) -> dict[str, object]:
        out: dict[str, object] = {}
        for key, value in self.__dict__.items():
            out[key] = value.__dict__ if isinstance(value, Percentiles) else value
        return out

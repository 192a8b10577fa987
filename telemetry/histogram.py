"""A cumulative latency histogram a worker keeps and ships in ``WorkerStats`` (Prometheus shape)."""

from __future__ import annotations

import bisect

import msgspec


class HistogramData(msgspec.Struct, frozen=True, kw_only=True):
    """Bucket counts of a histogram: ``counts[i]`` observations in ``(bounds[i-1], bounds[i]]``; the
    last count is above every bound (``len(counts) == len(bounds) + 1``)."""

    bounds: list[float]
    counts: list[int]
    sum: float


# vLLM's request-queue-time buckets (seconds).
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                   10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)


# --kv-eviction's per-request figures: the share of a request's tokens still held, and head budgets in tokens
FRACTION_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)
TOKEN_BUCKETS = (16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0, 16384.0, 32768.0,
                 65536.0, 131072.0)


class Histogram:
    """``counts[i]`` counts observations ``<= bounds[i]`` and above ``bounds[i-1]``; the last slot is +Inf."""

    def __init__(self, bounds: tuple[float, ...] = LATENCY_BUCKETS) -> None:
        self.bounds = list(bounds)
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def data(self) -> HistogramData:
        return HistogramData(bounds=list(self.bounds), counts=list(self.counts), sum=self.sum)

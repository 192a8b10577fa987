"""Arrival times and uniform request streams (what the live planner simulates its measured load as)."""

from __future__ import annotations

import numpy as np

from planner.simulator import RequestSpec

SHARED_PREFIX_ID = 0  # the one prefix of a uniform stream (``planner.workload``: the default system prompt)


def poisson_arrivals(rate: float, n: int, seed: int = 0) -> np.ndarray:
    """``n`` send times of a Poisson process at ``rate`` per second, the first at 0."""
    if not rate > 0:
        raise ValueError(f"--rate must be > 0, got {rate}")
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, n)
    return np.cumsum(gaps) - gaps[0] if n else gaps


def uniform_requests(rate: float, n: int, input_tokens: int, output_tokens: int, prefix_tokens: int,
                     seed: int = 0) -> list[RequestSpec]:
    """``n`` requests of the same lengths at Poisson times, all sharing their first ``prefix_tokens``."""
    pid = SHARED_PREFIX_ID if prefix_tokens > 0 else -1
    return [RequestSpec(input_tokens, output_tokens, float(t), pid, prefix_tokens)
            for t in poisson_arrivals(rate, n, seed)]

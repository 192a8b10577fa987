"""Routing policies: which prefill and which decode worker serve a request.

A policy sees ``Candidate`` rows (one per live worker of a role) and returns
the chosen one with a reason, for metrics. ``prefix`` minimises the work a
request adds: the tokens the worker must still compute (prefill) or receive
(decode, weighted by ``transfer_weight``; 1.0 by default because a decode
worker that holds the prefix can compute the rest itself under conditional
disaggregation, so a miss there usually costs a whole prefill) plus the
tokens already queued or running there, less the part of those that computes
this request's own prefix (``shared_load_tokens``: a request in flight there
shares its leading blocks; the worker computes them once, and this request
would wait for them wherever it went, so they are no extra work; the engine's
scheduler takes them from the cache once committed). Workers
without room for the blocks a request needs there (beyond the prefix they
hold) are passed over while any other has room.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Protocol

from engine.hashing import CACHE_WEIGHT, prefix_cost

POLICIES = ("prefix", "round-robin", "least-loaded")


@dataclass(frozen=True)
class Candidate:
    index: int
    worker_id: str
    prefix_tokens: int
    load_tokens: int
    free_blocks: int
    need_blocks: int = 0
    shared_load_tokens: int = 0


class RoutingPolicy(Protocol):
    name: str

    def pick(self, role: str, candidates: list[Candidate], prompt_tokens: int,
             need_blocks: int) -> tuple[Candidate, str]: ...


def _with_room(candidates: list[Candidate], need_blocks: int) -> list[Candidate]:
    """Workers with room for the blocks they lack (``need_blocks`` minus the prefix they hold)."""
    roomy = [c for c in candidates if c.free_blocks >= (c.need_blocks or need_blocks)]
    return roomy or sorted(candidates, key=lambda c: -c.free_blocks)[:1]


class RoundRobin:
    name = "round-robin"

    def __init__(self) -> None:
        self._counters: dict[str, itertools.count[int]] = {}

    def pick(self, role: str, candidates: list[Candidate], prompt_tokens: int,
             need_blocks: int) -> tuple[Candidate, str]:
        n = next(self._counters.setdefault(role, itertools.count()))
        return candidates[n % len(candidates)], "round_robin"


class LeastLoaded:
    name = "least-loaded"

    def pick(self, role: str, candidates: list[Candidate], prompt_tokens: int,
             need_blocks: int) -> tuple[Candidate, str]:
        pool = _with_room(candidates, need_blocks)
        return min(pool, key=lambda c: (c.load_tokens, -c.free_blocks, c.index)), "least_loaded"


class PrefixAware:
    name = "prefix"

    def __init__(self, transfer_weight: float = 1.0, cache_weight: float = CACHE_WEIGHT) -> None:
        self.transfer_weight = transfer_weight
        self.cache_weight = cache_weight

    def cost(self, role: str, c: Candidate, prompt_tokens: int) -> float:
        """``engine/hashing.py:prefix_cost``, a decode worker's missing tokens weighted by
        ``transfer_weight`` too."""
        weight = self.cache_weight * (1.0 if role == "prefill" else self.transfer_weight)
        return prefix_cost(c.load_tokens, c.shared_load_tokens, prompt_tokens, c.prefix_tokens, weight)

    def pick(self, role: str, candidates: list[Candidate], prompt_tokens: int,
             need_blocks: int) -> tuple[Candidate, str]:
        pool = _with_room(candidates, need_blocks)
        best = min(pool, key=lambda c: (self.cost(role, c, prompt_tokens), c.index))
        top_prefix = max(c.prefix_tokens for c in pool)
        reason = "prefix_hit" if best.prefix_tokens > 0 and best.prefix_tokens == top_prefix else "load"
        return best, reason


def make_policy(name: str) -> RoutingPolicy:
    if name == "prefix":
        return PrefixAware()
    if name == "round-robin":
        return RoundRobin()
    if name == "least-loaded":
        return LeastLoaded()
    raise ValueError(f"--routing must be one of {', '.join(POLICIES)}, got {name!r}")

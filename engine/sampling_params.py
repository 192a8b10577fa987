"""``SamplingParams``: how one request picks its tokens (pure Python, no torch).

It crosses the wire as itself (msgspec encodes and validates dataclasses), so
the router, the messages and the engine share one definition.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

MAX_LOGPROBS = 20
_INT_FIELDS = frozenset({"n", "max_tokens", "min_tokens", "top_k", "seed", "logprobs"})
_FLOAT_FIELDS = frozenset(
    {"temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"}
)


def _require(ok: bool, name: str, allowed: str, value: object) -> None:
    if not ok:
        raise ValueError(f"{name} must be {allowed}, got {value!r}")


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens for one request (vLLM names, OpenAI ranges).

    ``top_k`` 0 or -1 means off; ``max_tokens=None`` means up to the model's
    context length; ``logprobs`` is how many top alternatives to return per
    generated token (the sampled token's own logprob is always returned when it
    is not None). The engine runs ``n == 1`` only; the router fans out ``n``.
    """

    n: int = 1
    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in _INT_FIELDS and value is not None:
                _require(type(value) is int, f.name, "an integer", value)
            if f.name in _FLOAT_FIELDS:
                is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
                _require(is_number and math.isfinite(value), f.name, "a finite number", value)
        stop_ok = all(type(t) is int and t >= 0 for t in self.stop_token_ids)
        self._check(stop_ok, "stop_token_ids", "non-negative integers")
        self._check(self.n >= 1, "n", ">= 1")
        self._check(self.max_tokens is None or self.max_tokens >= 1, "max_tokens", ">= 1 or None")
        self._check(self.min_tokens >= 0, "min_tokens", ">= 0")
        min_ok = self.max_tokens is None or self.min_tokens <= self.max_tokens
        self._check(min_ok, "min_tokens", f"<= max_tokens ({self.max_tokens})")
        self._check(0.0 <= self.temperature <= 2.0, "temperature", "in [0, 2]")
        self._check(self.top_k >= -1, "top_k", "-1 or 0 (off) or >= 1")
        self._check(0.0 < self.top_p <= 1.0, "top_p", "in (0, 1]")
        self._check(0.0 <= self.min_p <= 1.0, "min_p", "in [0, 1]")
        self._check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "in [-2, 2]")
        self._check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "in [-2, 2]")
        self._check(self.repetition_penalty > 0.0, "repetition_penalty", "> 0")
        logprobs_ok = self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS
        self._check(logprobs_ok, "logprobs", f"in [0, {MAX_LOGPROBS}] or None")
        self._check(isinstance(self.ignore_eos, bool), "ignore_eos", "a bool")

    def _check(self, ok: bool, name: str, allowed: str) -> None:
        _require(ok, name, allowed, getattr(self, name))

    @property
    def greedy(self) -> bool:
        """True when the draw is a plain argmax."""
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

"""``SamplingParams``: how one request picks its tokens (pure Python, no torch).

It crosses the wire as itself (msgspec encodes and validates dataclasses), so
the router, the messages and the engine share one definition.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0
STRUCTURED_KINDS = ("json_schema", "json_object", "regex", "choice", "lark")
_INT_FIELDS = frozenset({"n", "max_tokens", "min_tokens", "top_k", "seed", "logprobs"})
_FLOAT_FIELDS = frozenset(
    {"temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"}
)


def _require(ok: bool, name: str, allowed: str, value: object) -> None:
    if not ok:
        raise ValueError(f"{name} must be {allowed}, got {value!r}")


@dataclass(frozen=True)
class StructuredOutput:
    """A grammar every generated token must follow (``engine.grammar`` turns it into one).

    ``kind``: ``json_schema`` (``spec`` is the schema as JSON text), ``json_object`` (any JSON object;
    ``spec`` empty), ``regex``, ``choice`` (``spec`` is a JSON list of strings) or ``lark`` (a Lark
    grammar, llguidance's dialect). ``resumed_tokens``: the last that many prompt tokens were already
    generated under this grammar (a migrated request's continuation); the engine replays them into the
    grammar's state before sampling.
    """

    kind: str
    spec: str = ""
    resumed_tokens: int = 0

    def __post_init__(self) -> None:
        _require(self.kind in STRUCTURED_KINDS, "structured.kind", f"one of {STRUCTURED_KINDS}", self.kind)
        _require(type(self.resumed_tokens) is int and self.resumed_tokens >= 0, "structured.resumed_tokens",
                 ">= 0", self.resumed_tokens)

    @property
    def key(self) -> tuple[str, str]:
        """What a compiled grammar is cached under."""
        return self.kind, self.spec


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens for one request (vLLM names, OpenAI ranges).

    ``top_k`` 0 or -1 means off; ``max_tokens=None`` means up to the model's
    context length; ``logprobs`` is how many top alternatives to return per
    generated token (the sampled token's own logprob is always returned when it
    is not None). The engine runs ``n == 1`` only; the router fans out ``n``.
    ``structured`` constrains every token to a grammar (``engine.structured``);
    ``logit_bias`` adds ``bias`` to token ``id``'s logit before anything else.
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
    structured: StructuredOutput | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "logit_bias", tuple((t, b) for t, b in self.logit_bias))
        bias_ok = all(type(t) is int and t >= 0 and isinstance(b, (int, float)) and not isinstance(b, bool)
                      and -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS for t, b in self.logit_bias)
        _require(bias_ok, "logit_bias", f"token ids >= 0 with biases in [-{MAX_LOGIT_BIAS:g}, "
                 f"{MAX_LOGIT_BIAS:g}]", self.logit_bias)
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

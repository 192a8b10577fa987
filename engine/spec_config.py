"""``speculative_config``: the engine argument (and ``--speculative-config``) that turns on
speculative decoding, in vLLM's shape.

Two methods:

* ``{"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": N, "prompt_lookup_min": M}``:
  prompt lookup (``engine/ngram.py``); no extra model.
* ``{"method": "draft_model", "model": PATH, "num_speculative_tokens": K}``: a smaller model with
  the target's vocabulary (a Hugging Face folder or a GGUF file) proposes greedily
  (``engine/draft.py``); it runs where decoding runs, on its own paged KV of as many blocks as the
  target's pool.

Adaptive speculation (``engine/spec_decode.py``), with pdserve's own keys: a request whose
recent acceptance (an exponential average of accepted / proposed, weight ``acceptance_decay``
on the past) falls below ``min_acceptance`` stops speculating for a pause that doubles each
time (from 4 steps up to ``max_pause_steps``), and while its average is between
``min_acceptance`` and 1 it proposes ``ceil(K x average)`` tokens. ``min_acceptance=0`` turns
this off.

This module is light (no torch): ``engine.config`` checks the dict with it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

SPEC_METHODS = ("ngram", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    model: str | None = None
    min_acceptance: float = 0.15
    acceptance_decay: float = 0.7
    max_pause_steps: int = 64

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            choices = ", ".join(SPEC_METHODS)
            raise ValueError(f"speculative method must be one of {choices}, got {self.method!r}")
        if self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be at least 1, got {self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                             f"{self.prompt_lookup_min} and {self.prompt_lookup_max}")
        if not 0.0 <= self.min_acceptance < 1.0:
            raise ValueError(f"min_acceptance must be in [0, 1), got {self.min_acceptance}")
        if not 0.0 <= self.acceptance_decay < 1.0:
            raise ValueError(f"acceptance_decay must be in [0, 1), got {self.acceptance_decay}")
        if self.max_pause_steps < 1:
            raise ValueError(f"max_pause_steps must be at least 1, got {self.max_pause_steps}")
        if self.method == "draft_model":
            if not self.model:
                raise ValueError("speculative method draft_model needs a 'model' (a local path)")
        elif self.model is not None:
            raise ValueError("'model' goes with speculative method draft_model only")

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> SpeculativeConfig:
        """Build from vLLM's dict; unknown keys are an error naming them."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown speculative_config key(s): {', '.join(unknown)}; "
                             f"known: {', '.join(sorted(known))}")
        return cls(**dict(values))


def parse_speculative_config(text: str) -> dict[str, Any]:
    """``--speculative-config``'s value: a JSON object, or ``key=value`` pairs joined by commas (the
    form a ``--config`` file's mapping takes). Numbers are converted; the result is checked."""
    text = text.strip()
    if text.startswith("{"):
        try:
            values = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"invalid JSON: {exc}") from None
        if not isinstance(values, dict):
            raise ValueError("must be a JSON object")
    else:
        values = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, sep, value = part.partition("=")
            if not sep:
                raise ValueError(f"expected key=value, got {part!r}")
            values[key.strip()] = _scalar(value.strip())
    SpeculativeConfig.from_dict(values)
    return values


def _scalar(text: str) -> Any:
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text

"""The named workloads of ``pdserve bench`` and ``pdserve simulate``: their parameters and defaults.

One definition for both sides: the load generator (``bench/workloads.py``) builds text from these
parameters, the simulator (``planner/workload.py``) draws the same lengths without any text. This module
imports nothing of the project, so the load generator (which talks to a server over HTTP only) and the
planner may both read it.

``workload_params(name, params)`` is the one validation: an unknown workload or parameter name, or a
negative value, is a ``ValueError`` naming the flag (``--workload`` or ``--param``); otherwise it returns
``params`` over the workload's defaults.
"""

from __future__ import annotations

from collections.abc import Sequence

DEFAULTS: dict[str, dict[str, float]] = {
    "random": {"input_len": 256, "output_len": 64},
    "shared-prefix": {"num_prefixes": 8, "questions_per_prefix": 16, "prefix_len": 512, "question_len": 32,
                      "output_len": 32, "share": 1.0},
    "multi-turn": {"turns": 4, "user_len": 64, "output_len": 64},
    "long-context": {"context_len": 2048, "output_len": 32, "margin": 64},
    "mixed": {"rag_share": 0.2, "short_min": 16, "short_max": 128, "rag_min": 768, "rag_max": 1536,
              "rag_system_len": 64, "output_min": 16, "output_max": 128},
    "copy-heavy": {"sentences": 8, "functions": 3, "code_share": 0.5, "output_len": 128},
}
WORKLOADS = tuple(DEFAULTS)


def parse_params(items: Sequence[str]) -> dict[str, float]:
    """``["input_len=128", "share=0.5"]`` -> ``{"input_len": 128.0, "share": 0.5}``.

    ValueError names the bad item."""
    out: dict[str, float] = {}
    for item in items:
        for part in filter(None, item.split(",")):
            key, sep, value = part.partition("=")
            try:
                if not sep:
                    raise ValueError
                out[key.strip().replace("-", "_")] = float(value)
            except ValueError:
                raise ValueError(f"--param: expected KEY=NUMBER, got {part!r}") from None
    return out


def workload_params(name: str, params: dict[str, float] | None = None) -> dict[str, float]:
    """``params`` over the defaults of workload ``name``; ValueError for an unknown name or key."""
    if name not in DEFAULTS:
        raise ValueError(f"--workload: unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
    merged = dict(DEFAULTS[name])
    for key, value in (params or {}).items():
        if key not in merged:
            raise ValueError(f"--param: workload {name!r} has no parameter {key!r}; "
                             f"it has {', '.join(sorted(merged))}")
        if value < 0:
            raise ValueError(f"--param: {key} must be >= 0, got {value}")
        merged[key] = value
    return merged

"""Per-request records and the statistics of a run: latency percentiles, throughput, SLO goodput.

Definitions (all times in seconds):

- TTFT: from sending the request to the first streamed chunk with text.
- ITL: the gaps between consecutive text chunks of one request (all gaps pooled).
- TPOT: per request, ``(e2e - ttft) / (output_tokens - 1)`` (requests with > 1 output token).
- E2E: from sending to the end of the stream.
- A request meets the SLO when it succeeded, its TTFT <= ``slo.ttft``, its mean ITL <= ``slo.itl``
  and its E2E <= ``slo.e2e`` (each bound only when given). Goodput = such requests (and their output
  tokens) per second of the run; attainment = such requests / all requests sent.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

PERCENTILES = (50, 90, 99)
_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s)?\s*$")


@dataclass
class RequestRecord:
    """What the client saw of one request."""

    start: float
    status: str = "ok"
    ttft: float | None = None
    e2e: float | None = None
    chunk_gaps: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    label: str = ""
    session: int = 0
    turn: int = 0
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def tpot(self) -> float | None:
        if not self.ok or self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    @property
    def mean_itl(self) -> float | None:
        return sum(self.chunk_gaps) / len(self.chunk_gaps) if self.chunk_gaps else None


@dataclass(frozen=True)
class SLO:
    ttft: float | None = None
    itl: float | None = None
    e2e: float | None = None

    def met(self, r: RequestRecord) -> bool:
        if not r.ok or r.ttft is None:
            return False
        if self.ttft is not None and r.ttft > self.ttft:
            return False
        itl = r.mean_itl
        if self.itl is not None and itl is not None and itl > self.itl:
            return False
        return not (self.e2e is not None and (r.e2e is None or r.e2e > self.e2e))

    def as_dict(self) -> dict[str, float | None]:
        return {"ttft_s": self.ttft, "itl_s": self.itl, "e2e_s": self.e2e}


def parse_slo(text: str) -> SLO:
    """``"ttft=500ms,itl=0.1s,e2e=20s"``: a bare number is milliseconds. ValueError names ``--slo``."""
    values: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, raw = part.partition("=")
        match = _DURATION_RE.match(raw)
        if not sep or key not in ("ttft", "itl", "e2e") or match is None:
            raise ValueError(f"--slo: expected ttft=..., itl=..., e2e=... with ms or s, got {part!r}")
        number = float(match.group(1))
        values[key] = number if match.group(2) == "s" else number / 1000.0
    if not values:
        raise ValueError("--slo: give at least one of ttft=, itl=, e2e=")
    return SLO(**values)


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default method); NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def describe(values: Sequence[float]) -> dict[str, float | int]:
    """count, mean and p50/p90/p99 in milliseconds (NaN when empty)."""
    out: dict[str, float | int] = {"count": len(values),
                                   "mean_ms": 1000 * sum(values) / len(values) if values else math.nan}
    for q in PERCENTILES:
        out[f"p{q}_ms"] = 1000 * percentile(values, q)
    return out


def summarize(records: Sequence[RequestRecord], duration: float, slo: SLO | None) -> dict[str, Any]:
    """The run's figures over ``duration`` seconds (from the first send to the last answer)."""
    ok = [r for r in records if r.ok]
    duration = max(duration, 1e-9)
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    summary: dict[str, Any] = {
        "requests": len(records),
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "errors": dict(Counter(r.status for r in records if not r.ok)),
        "duration_s": duration,
        "input_tokens": in_tokens,
        "output_tokens": out_tokens,
        "request_throughput": len(ok) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "ttft": describe([r.ttft for r in ok if r.ttft is not None]),
        "itl": describe([g for r in ok for g in r.chunk_gaps]),
        "tpot": describe([t for r in ok if (t := r.tpot) is not None]),
        "e2e": describe([r.e2e for r in ok if r.e2e is not None]),
    }
    if slo is not None:
        good = [r for r in records if slo.met(r)]
        summary["slo"] = slo.as_dict()
        summary["good_requests"] = len(good)
        summary["slo_attainment"] = len(good) / len(records) if records else math.nan
        summary["goodput"] = len(good) / duration
        summary["good_output_throughput"] = sum(r.output_tokens for r in good) / duration
    return summary

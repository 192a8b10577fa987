"""What the router served over a stretch of time, for the planner: arrivals, tokens, latencies.

``PDClient.generate`` feeds one ``LoadWindow``: each request's arrival and prompt size, its time to
first token and the prompt tokens the worker found cached, the tokens of every later batch, and, when
it finishes, its inter-token latency: the mean time per output token after the first (``(end -
first token) / (tokens - 1)``, vLLM's TPOT). Per request, not per token gap, so a request that
waited seconds for a decode batch slot after its first token (the first token comes from prefill)
counts as one slow request rather than one slow gap among many fast ones. ``take`` hands the samples
since the last ``take`` over as a ``Served`` and starts a new window; ``Served.merge`` joins windows.
Nothing here waits or knows about workers.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class Served:
    """One window's samples; latencies in seconds."""

    seconds: float = 0.0
    requests: int = 0
    prompt_tokens: int = 0
    first_tokens: int = 0  # requests whose first token came in this window ...
    first_prompt_tokens: int = 0  # ... their prompt tokens ...
    cached_tokens: int = 0  # ... and of those, the ones a worker's prefix cache held
    output_tokens: int = 0
    finished: int = 0
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)  # per finished request: seconds per token after the first

    @staticmethod
    def merge(windows: list[Served]) -> Served:
        out = Served()
        for w in windows:
            out.seconds += w.seconds
            out.requests += w.requests
            out.prompt_tokens += w.prompt_tokens
            out.first_tokens += w.first_tokens
            out.first_prompt_tokens += w.first_prompt_tokens
            out.cached_tokens += w.cached_tokens
            out.output_tokens += w.output_tokens
            out.finished += w.finished
            out.ttft += w.ttft
            out.itl += w.itl
        return out


class LoadWindow:
    def __init__(self) -> None:
        self._started = time.monotonic()
        self._served = Served()

    def arrived(self, prompt_tokens: int) -> None:
        self._served.requests += 1
        self._served.prompt_tokens += prompt_tokens

    def first(self, seconds: float, prompt_tokens: int, cached_tokens: int, tokens: int) -> None:
        s = self._served
        s.ttft.append(seconds)
        s.first_tokens += 1
        s.first_prompt_tokens += prompt_tokens
        s.cached_tokens += min(cached_tokens, prompt_tokens)
        s.output_tokens += tokens

    def later(self, tokens: int) -> None:
        self._served.output_tokens += tokens

    def done(self, after_first_s: float, tokens: int) -> None:
        """A request finished ``after_first_s`` seconds after its first token, with ``tokens`` in all."""
        self._served.finished += 1
        if tokens > 1:
            self._served.itl.append(after_first_s / (tokens - 1))

    def take(self) -> Served:
        """The samples since the last call; a new window starts now."""
        now = time.monotonic()
        served, self._served = self._served, Served()
        served.seconds, self._started = now - self._started, now
        return served

"""What the router served over a stretch of time, for the planner: arrivals, tokens, latencies.

``PDClient.generate`` feeds one ``LoadWindow``: each request's arrival and prompt size, its time to
first token and the prompt tokens the worker found cached, then every later token batch's gap
(spread over its tokens: an inter-token latency) and size. ``take`` hands the samples since the last
``take`` over as a ``Served`` and starts a new window. Nothing here waits or knows about workers.
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
    itl: list[float] = field(default_factory=list)


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

    def later(self, gap: float, tokens: int) -> None:
        if tokens > 0:
            self._served.itl.append(gap / tokens)
            self._served.output_tokens += tokens

    def done(self) -> None:
        self._served.finished += 1

    def take(self) -> Served:
        """The samples since the last call; a new window starts now."""
        now = time.monotonic()
        served, self._served = self._served, Served()
        served.seconds, self._started = now - self._started, now
        return served

"""What the engine hands back to callers: finished (or streaming) request outputs."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from engine.sampling import TokenLogprobs

FinishReason = Literal["stop", "length", "abort"]


@dataclass
class RequestMetrics:
    """Per-request timings (``time.monotonic()`` seconds) and token counts."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    output_tokens: int = 0
    num_preemptions: int = 0
    spec_draft_tokens: int = 0  # tokens proposed by speculative decoding and verified
    spec_accepted_tokens: int = 0  # of which accepted
    kv_evicted_tokens: int = 0  # --kv-eviction: tokens of this request's KV freed (engine/kv_eviction.py)
    # --kv-eviction headwise: each layer's KV head budget in tokens at the request's last eviction
    kv_head_budgets: tuple[int, ...] = ()

    @property
    def ttft(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def queue_time(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def e2e_latency(self) -> float | None:
        if self.finish_time is None:
            return None
        return self.finish_time - self.arrival_time


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    finished: bool
    finish_reason: FinishReason | None
    metrics: RequestMetrics
    logprobs: list[TokenLogprobs] | None = None
    stop_token_id: int | None = None
    new_token_ids: list[int] = field(default_factory=list)
    # turns token ids into text when ``text`` is first read, on the reader's thread: the engine's
    # step never detokenizes (streaming callers read token ids; the router detokenizes them itself)
    detokenize: Callable[[list[int]], str] | None = field(default=None, repr=False, compare=False)
    _text: str | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def text(self) -> str:
        """The finished output's text (decoded once, on first read); ``""`` while unfinished."""
        if not self.finished or self.detokenize is None:
            return ""
        if self._text is None:
            self._text = self.detokenize(self.token_ids)
        return self._text

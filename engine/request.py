"""A request's state inside one engine."""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING

from engine.outputs import FinishReason, RequestMetrics
from engine.sampling import SamplingParams, SamplingState, TokenLogprobs

if TYPE_CHECKING:
    from engine.structured import Guide


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Request:
    """Prompt, generated tokens and progress of one sequence.

    ``num_computed_tokens`` counts tokens whose K/V are in the cache. When it
    reaches ``num_tokens`` the next token is sampled; a preempted request goes
    back to 0 (recompute) and keeps its generated tokens.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        eos_token_ids: tuple[int, ...] = (),
        prompt: str | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        hold_kv: bool = False,
    ) -> None:
        if not prompt_token_ids:
            raise ValueError("a prompt must have at least one token")
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.priority = priority
        self.hold_kv = hold_kv
        self.eos_token_ids = eos_token_ids
        self.sampling = SamplingState(
            params=params,
            prompt_token_ids=self.prompt_token_ids,
            output_token_ids=[],
            eos_token_ids=eos_token_ids,
        )
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        # tokens whose K/V were dropped by the sliding window (whole blocks after the sinks)
        self.kv_dropped_tokens = 0
        self.finish_reason: FinishReason | None = None
        self.stop_token_id: int | None = None
        self.logprobs: list[TokenLogprobs] = []
        # the grammar's state when the output is constrained: advanced by every appended token
        self.guide: Guide | None = None
        self.metrics = RequestMetrics(
            arrival_time=time.monotonic() if arrival_time is None else arrival_time,
            prompt_tokens=len(prompt_token_ids),
        )

    @property
    def output_token_ids(self) -> list[int]:
        return self.sampling.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def kv_tokens(self) -> int:
        """Computed tokens whose K/V are still held (the sliding window drops whole blocks)."""
        return self.num_computed_tokens - self.kv_dropped_tokens

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def append_token(self, token_id: int, logprobs: TokenLogprobs | None, max_len: int) -> None:
        """Record a sampled token and decide whether the request is done."""
        self.output_token_ids.append(token_id)
        if logprobs is not None:
            self.logprobs.append(logprobs)
        self.metrics.output_tokens = len(self.output_token_ids)
        now = time.monotonic()
        if self.metrics.first_token_time is None:
            self.metrics.first_token_time = now
        if self.guide is not None and not self.guide.accept(token_id):
            self._finish("abort")  # a token the mask should have excluded: never streamed on as valid
            return
        params = self.params
        n_out = len(self.output_token_ids)
        if n_out >= params.min_tokens:
            if token_id in params.stop_token_ids:
                self._finish("stop", token_id)
                return
            if not params.ignore_eos and token_id in self.eos_token_ids:
                self._finish("stop", token_id)
                return
        if (params.max_tokens is not None and n_out >= params.max_tokens) or self.num_tokens >= max_len:
            self._finish("length")
        elif self.guide is not None and self.guide.stopped:
            self._finish("stop")  # the grammar is complete and nothing may follow

    def abort(self) -> None:
        self._finish("abort")

    def _finish(self, reason: FinishReason, stop_token_id: int | None = None) -> None:
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
        self.stop_token_id = stop_token_id
        self.metrics.finish_time = time.monotonic()

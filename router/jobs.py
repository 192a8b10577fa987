"""One HTTP generation request as the requests it fans out into: ``len(prompts) x n`` of them, one per
choice, each with its decoder (text, stop strings) and logprob formatter (``JobBuilder.build``).

Lengths are checked here: a prompt at or past ``max_model_len``, or one whose ``max_tokens`` would run
past it, is a 400 (``context_length_exceeded``) naming the field; each request carries the engine's own
``SamplingParams`` (``router.protocol.sampling_for``: a value the engine refuses is a 400 there).
"""

from __future__ import annotations

import functools
import time
import uuid
from dataclasses import dataclass

from engine.sampling_params import StructuredOutput
from engine.tokenizer import Tokenizer
from messages.wire import GenerateRequest
from router.config import RouterConfig
from router.errors import invalid
from router.protocol import CompletionParams, logit_bias_of, sampling_for, stop_strings
from router.responses import Envelope, Json, LogprobFormatter, usage
from router.streaming import ChoiceDecoder
from router.telemetry import RequestTelemetry
from router.tools import ToolMode


@dataclass
class Job:
    """One HTTP generation request, fanned out into ``len(prompts) x n`` requests to the cluster."""

    req: CompletionParams
    chat: bool
    envelope: Envelope
    prompts: list[list[int]]
    requests: list[GenerateRequest]
    decoders: list[ChoiceDecoder]
    formatters: list[LogprobFormatter]
    tools: ToolMode | None = None  # parse tool calls out of the output
    echo: list[str] | None = None  # completions ``echo``: each prompt's text, ahead of its choices' text

    def echoed(self, index: int) -> str:
        return self.echo[index // self.req.choices] if self.echo else ""

    def finish_reason(self, reason: str | None, calls: int) -> str | None:
        return "tool_calls" if calls and reason == "stop" else reason

    def finish(self, tel: RequestTelemetry, error: BaseException | None = None) -> None:
        """Record usage and end the request's span (a second call does nothing)."""
        tel.finish(self.decoders, [len(p) for p in self.prompts], self.req.choices, error)

    def usage(self) -> Json:
        return usage(self.decoders, [len(p) for p in self.prompts], self.req.choices)

    def output_tokens(self) -> int:
        return sum(d.num_tokens for d in self.decoders)


class JobBuilder:
    def __init__(self, config: RouterConfig, tokenizer: Tokenizer) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.token_text = functools.lru_cache(maxsize=65536)(self._token_text)

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def build(self, req: CompletionParams, chat: bool, prompts: list[list[int]], param: str,
              structured: StructuredOutput | None = None) -> Job:
        """The job of ``req`` over tokenized ``prompts``; ``param`` names the prompt's field in errors."""
        config, n = self.config, req.choices
        bias = logit_bias_of(req, self.tokenizer.vocab_size)
        requests: list[GenerateRequest] = []
        prefix = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        for p_index, prompt in enumerate(prompts):
            if len(prompt) >= config.max_model_len:
                raise invalid(f"The prompt has {len(prompt)} tokens; this model's maximum context length is "
                              f"{config.max_model_len} tokens.", param, code="context_length_exceeded")
            room = config.max_model_len - len(prompt)
            max_tokens = req.requested_max_tokens() or config.default_max_tokens or room
            if max_tokens > room:
                raise invalid(f"The prompt ({len(prompt)} tokens) plus max_tokens ({max_tokens}) exceeds "
                              f"this model's maximum context length of {config.max_model_len} tokens.",
                              "max_tokens", code="context_length_exceeded")
            for i in range(n):
                requests.append(GenerateRequest(
                    request_id=f"{prefix}-{p_index * n + i}", prompt_token_ids=prompt,
                    sampling=sampling_for(req, max_tokens, i, structured, bias), priority=req.priority or 0))
        stops = stop_strings(req)
        tier = "default" if getattr(req, "service_tier", None) is not None else None
        return Job(
            req, chat, Envelope(prefix, int(time.time()), config.model_name, chat, tier), prompts, requests,
            [ChoiceDecoder(i, self.tokenizer, stops) for i in range(len(requests))],
            [LogprobFormatter(chat, self.token_text) for _ in requests])

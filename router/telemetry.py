"""One HTTP generation request's span and latency metrics at the router.

``RequestTelemetry`` opens the ``router`` span at admission (a child of the
incoming ``traceparent`` when there is one), stamps its W3C context into every
backend ``GenerateRequest`` so the workers' spans join the same trace, observes
time to first token and inter-delta latency as text arrives, and on ``finish``
records the usage (OpenTelemetry GenAI attribute names) and the end-to-end
latency. Without tracing the span is None and only the metrics are kept.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from messages.wire import GenerateRequest
from router.metrics import RouterMetrics
from router.streaming import ChoiceDecoder
from telemetry.tracing import AttrValue, Tracing, end_span


class RequestTelemetry:
    def __init__(self, tracing: Tracing, metrics: RouterMetrics, headers: Mapping[str, str], chat: bool,
                 model: str, requests: Sequence[GenerateRequest], response_id: str) -> None:
        self.metrics = metrics
        self.tracing = tracing
        self.admitted = time.monotonic()
        self.last = self.admitted
        self.span: Any = None
        if tracing.enabled:
            s = requests[0].sampling
            attrs: dict[str, AttrValue] = {
                "gen_ai.operation.name": "chat" if chat else "text_completion",
                "gen_ai.request.model": model, "gen_ai.response.id": response_id,
                "gen_ai.request.temperature": s.temperature, "gen_ai.request.choice.count": s.n,
            }
            if s.max_tokens is not None:
                attrs["gen_ai.request.max_tokens"] = s.max_tokens
            self.span = tracing.start_span("router", dict(headers), attributes=attrs)

    def stamp(self, requests: list[GenerateRequest]) -> list[GenerateRequest]:
        """The backend requests carrying this span's W3C context (unchanged when not traced)."""
        carrier = self.tracing.carrier(self.span)
        if not carrier:
            return requests
        return [msgspec.structs.replace(r, trace_context=carrier) for r in requests]

    def first_token(self) -> None:
        now = time.monotonic()
        ttft = now - self.admitted
        self.last = now
        self.metrics.time_to_first_token.observe(ttft)
        if self.span is not None:
            self.span.set_attribute("gen_ai.server.time_to_first_token", ttft)
            self.span.add_event("first_token")

    def delta(self) -> None:
        now = time.monotonic()
        self.metrics.inter_token_latency.observe(now - self.last)
        self.last = now

    def finish(self, decoders: Sequence[ChoiceDecoder], prompt_lens: Sequence[int], n: int,
               error: BaseException | None = None) -> None:
        """Record usage and end the span (idempotent: a second call does nothing)."""
        if self.admitted < 0:
            return
        output = sum(d.num_tokens for d in decoders)
        prompt = sum(prompt_lens)
        if error is None:
            self.metrics.e2e_latency.observe(time.monotonic() - self.admitted)
            self.metrics.prompt_tokens.inc(prompt)
            self.metrics.generation_tokens.inc(output)
        self.admitted = -1.0
        if self.span is None:
            return
        cached = sum(decoders[i * n].cached_tokens for i in range(len(prompt_lens)) if i * n < len(decoders))
        self.span.set_attributes({
            "gen_ai.usage.input_tokens": prompt, "gen_ai.usage.output_tokens": output,
            "gen_ai.usage.cache_read.input_tokens": cached,
            "gen_ai.response.finish_reasons": [d.finish_reason or "" for d in decoders],
            "pdserve.decode_worker": decoders[0].worker_id if decoders else "",
        })
        end_span(self.span, None if error is None else f"{type(error).__name__}: {error}")

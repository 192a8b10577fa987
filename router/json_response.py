"""A whole (non-streaming) completion as one JSON body: every choice's text, logprobs and tool calls."""

from __future__ import annotations

from collections.abc import AsyncGenerator

import msgspec
from starlette.responses import Response

from router.errors import api_error
from router.jobs import Job
from router.metrics import RouterMetrics
from router.responses import Json, choice, merge_logprobs
from router.streaming import ChoiceDelta
from router.telemetry import RequestTelemetry
from router.tools import parse


async def json_response(job: Job, first: ChoiceDelta, deltas: AsyncGenerator[ChoiceDelta, None],
                        tel: RequestTelemetry, headers: dict[str, str], metrics: RouterMetrics,
                        request_timeout: float) -> Response:
    """Read ``deltas`` (``first`` already read) to the end; a failure on the way is its API error."""
    texts: list[list[str]] = [[] for _ in job.requests]
    lps: list[list[Json]] = [[] for _ in job.requests]
    try:
        delta: ChoiceDelta | None = first
        while delta is not None:
            texts[delta.index].append(delta.text)
            if delta.logprobs:
                lps[delta.index].append(job.formatters[delta.index].format(delta.logprobs))
            delta = await anext(deltas, None)
            if delta is not None:
                tel.delta()
    except BaseException as exc:
        job.finish(tel, exc)
        raise api_error(exc, request_timeout) from None
    job.finish(tel)
    want_lps = job.req.num_logprobs() is not None
    choices = []
    for i, d in enumerate(job.decoders):
        text: str | None = job.echoed(i) + "".join(texts[i])
        calls: list[Json] = []
        if job.tools is not None and job.tools.parse and text is not None:
            text, parsed = parse(text, job.tools.names)
            calls = [c.openai() for c in parsed]
        lp = merge_logprobs(lps[i], job.chat) if want_lps else None
        choices.append(choice(i, text, job.chat, lp, job.finish_reason(d.finish_reason, len(calls)),
                              chunk=False, tool_calls=calls))
    metrics.output_tokens.inc(job.output_tokens())
    body = job.envelope.wrap(choices, chunk=False, usage=job.usage())
    return Response(msgspec.json.encode(body), media_type="application/json", headers=headers)

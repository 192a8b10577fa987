"""A streamed completion as server-sent events: a role chunk first (chat), one chunk per delta (tool
calls parsed out when asked, ``router.tool_chunks``), usage last when asked, then ``data: [DONE]``. A
failure after the first token ends the stream with an ``error`` event before ``[DONE]``."""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator

import msgspec

from router.admission import Ticket
from router.errors import ClientGone, api_error
from router.jobs import Job
from router.metrics import RouterMetrics
from router.responses import choice, role_chunk
from router.streaming import ChoiceDelta
from router.telemetry import RequestTelemetry
from router.tool_chunks import tool_call_chunks
from router.tools import ToolStream

DONE = b"data: [DONE]\n\n"


def sse(payload: msgspec.Struct | dict[str, object]) -> bytes:
    """One server-sent event: ``data: <json>`` and a blank line."""
    return b"data: " + msgspec.json.encode(payload) + b"\n\n"


async def sse_events(job: Job, first: ChoiceDelta, deltas: AsyncGenerator[ChoiceDelta, None], ticket: Ticket,
                     tel: RequestTelemetry, metrics: RouterMetrics,
                     request_timeout: float) -> AsyncIterator[bytes]:
    """The SSE chunks; the request's telemetry ends once, in ``finally``, with how the stream ended."""
    env, include_usage = job.envelope, job.req.include_usage
    want_lps = job.req.num_logprobs() is not None
    ended: BaseException | None = GeneratorExit("stream closed")
    parsing = job.tools is not None and job.tools.parse
    parsers = [ToolStream(job.tools.names if job.tools else set()) for _ in job.requests]
    echoed = [False] * len(job.requests)
    try:
        if job.chat:
            roles = [role_chunk(i) for i in range(len(job.requests))]
            yield sse(env.wrap(roles, chunk=True, with_usage=include_usage))
        delta: ChoiceDelta | None = first
        while delta is not None:
            text = delta.text
            if not echoed[delta.index]:
                echoed[delta.index] = True
                text = job.echoed(delta.index) + text
            if parsing:
                for ch in tool_call_chunks(job, parsers[delta.index], delta, text):
                    yield sse(env.wrap([ch], chunk=True, with_usage=include_usage))
            elif text or delta.finish_reason is not None or (delta.logprobs and want_lps):
                lp = job.formatters[delta.index].format(delta.logprobs) if want_lps else None
                ch = choice(delta.index, text, job.chat, lp, delta.finish_reason, chunk=True)
                yield sse(env.wrap([ch], chunk=True, with_usage=include_usage))
            delta = await anext(deltas, None)
            if delta is not None:
                tel.delta()
        metrics.output_tokens.inc(job.output_tokens())
        ended = None
        job.finish(tel)
        if include_usage:
            yield sse(env.wrap([], chunk=True, usage=job.usage()))
    except ClientGone as exc:
        ended = exc
        return
    except Exception as exc:
        ended = exc
        job.finish(tel, exc)
        yield sse(api_error(exc, request_timeout).body())
    finally:
        job.finish(tel, ended)
        ticket.release()
        await deltas.aclose()
    yield DONE

"""A streamed chat choice's chunks once tool calls are parsed out of its text (``router.tools``)."""

from __future__ import annotations

from router.jobs import Job
from router.responses import Json, choice
from router.streaming import ChoiceDelta
from router.tools import ToolStream, call_chunks


def tool_call_chunks(job: Job, parser: ToolStream, delta: ChoiceDelta, text: str) -> list[Json]:
    """The chunks of one delta: content pieces, and per complete call its id and name, then its
    arguments in pieces; the finish reason last."""
    events = parser.feed(text)
    if delta.finish_reason is not None:
        events += parser.flush()
    chunks: list[Json] = []
    for event in events:
        if isinstance(event, str):
            chunks.append(choice(delta.index, event, True, None, None, chunk=True))
        else:
            chunks += [choice(delta.index, None, True, None, None, chunk=True, tool_calls=[entry])
                       for entry in call_chunks(event, parser.calls - 1)]
    if delta.finish_reason is not None:
        reason = job.finish_reason(delta.finish_reason, parser.calls)
        chunks.append(choice(delta.index, None, True, None, reason, chunk=True))
    return chunks

"""From token batches to text: incremental detokenization, stop strings, fan-in of ``n`` choices, SSE.

Contracts:

* ``StopFilter`` never emits any part of a stop string: text that could still
  grow into one (the longest suffix that is a prefix of some stop string) is
  held back until the next piece decides it, and the text from the earliest
  match onwards is dropped.
* ``ChoiceDecoder`` feeds tokens one by one, so a stop string ends the choice at
  the token that completes it; ``num_tokens`` counts the tokens consumed up to
  and including that one.
* ``merge_choices`` runs one backend stream per choice and closes every stream
  it opened however it ends (finished, stop string, error, cancellation), so an
  unfinished request is aborted on every worker.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import anyio
import msgspec

from engine.tokenizer import IncrementalDetokenizer, Tokenizer
from messages.wire import ErrorKind, GenerateRequest, TokenBatch, TokenLogprob
from router.backend import Backend
from router.errors import RequestFailed

T = TypeVar("T")
log = logging.getLogger(__name__)
DONE = b"data: [DONE]\n\n"


class StopFilter:
    """Cuts a stream of text pieces at the earliest occurrence of any stop string."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self.stopped = False
        self._held = ""

    def push(self, piece: str) -> str:
        """Add decoded text; return the part that can no longer belong to a stop string."""
        if self.stopped:
            return ""
        buf = self._held + piece
        hits = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped = True
            self._held = ""
            return buf[:min(hits)]
        keep = 0
        for k in range(min(len(buf), max((len(s) for s in self.stops), default=1) - 1), 0, -1):
            if any(s.startswith(buf[-k:]) for s in self.stops):
                keep = k
                break
        self._held = buf[len(buf) - keep:]
        return buf[:len(buf) - keep]

    def flush(self) -> str:
        """At the end of generation, the held text is final (no stop string can complete it)."""
        out, self._held = self._held, ""
        return "" if self.stopped else out


@dataclass
class ChoiceDelta:
    """New text of one choice; ``logprobs`` cover the tokens consumed since the last delta with text."""

    index: int
    text: str
    logprobs: list[TokenLogprob]
    finish_reason: str | None = None


@dataclass
class ChoiceDecoder:
    index: int
    tokenizer: Tokenizer
    stops: Sequence[str]
    num_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: str | None = None
    worker_id: str = ""
    _detok: IncrementalDetokenizer = field(init=False)
    _filter: StopFilter = field(init=False)
    _pending: list[TokenLogprob] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._detok = IncrementalDetokenizer(self.tokenizer)
        self._filter = StopFilter(self.stops)

    def feed(self, batch: TokenBatch) -> ChoiceDelta:
        """Consume one batch; the delta's ``finish_reason`` is set when this choice has ended (later
        batches are ignored)."""
        if self.finish_reason is not None:
            return ChoiceDelta(self.index, "", [], self.finish_reason)
        self.prompt_tokens = batch.prompt_tokens or self.prompt_tokens
        self.cached_tokens = max(self.cached_tokens, batch.cached_tokens)
        self.worker_id = self.worker_id or batch.worker_id
        text: list[str] = []
        for i, token in enumerate(batch.token_ids):
            self.num_tokens += 1
            if batch.logprobs is not None and i < len(batch.logprobs):
                self._pending.append(batch.logprobs[i])
            text.append(self._filter.push(self._detok.feed([token])))
            if self._filter.stopped:
                self.finish_reason = "stop"
                break
        if batch.finished and self.finish_reason is None:
            text.append(self._filter.push(self._detok.flush()))
            text.append(self._filter.flush())
            self.finish_reason = "stop" if self._filter.stopped else (batch.finish_reason or "stop")
        out = "".join(text)
        logprobs: list[TokenLogprob] = []
        if out or self.finish_reason is not None:
            logprobs, self._pending = self._pending, []
        return ChoiceDelta(self.index, out, logprobs, self.finish_reason)


async def _close(it: AsyncIterator[object]) -> None:
    aclose: Callable[[], Awaitable[None]] | None = getattr(it, "aclose", None)
    if aclose is not None:
        await aclose()


async def merge_choices(backend: Backend, requests: Sequence[GenerateRequest],
                        decoders: Sequence[ChoiceDecoder]) -> AsyncGenerator[ChoiceDelta, None]:
    """Run every request concurrently; yield deltas as they come until every choice has finished."""
    queue: asyncio.Queue[ChoiceDelta | BaseException] = asyncio.Queue()

    async def pump(req: GenerateRequest, decoder: ChoiceDecoder) -> None:
        stream = backend.generate(req)
        try:
            async for batch in stream:
                delta = decoder.feed(batch)
                if delta.finish_reason == "abort":
                    raise RequestFailed(ErrorKind.ABORTED,
                                        f"request {req.request_id} was aborted by the server")
                queue.put_nowait(delta)
                if delta.finish_reason is not None:
                    return
            raise RequestFailed(ErrorKind.ABORTED, f"request {req.request_id} ended without finishing")
        except Exception as exc:
            queue.put_nowait(exc)
        finally:
            await _close(stream)

    tasks = [asyncio.create_task(pump(r, d)) for r, d in zip(requests, decoders, strict=True)]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            if item.finish_reason is not None:
                remaining -= 1
            yield item
    finally:
        with anyio.CancelScope(shield=True):  # let every abort reach the workers
            # Abort the unfinished requests first, then cancel their reads: a read waiting on a worker's
            # next item may only give way once that item arrives (a Ray stream's), and the worker answers
            # an abort with the request's last, aborted output (``AsyncEngine.abort``), which ends it.
            await asyncio.gather(*[backend.abort(r.request_id) for r, t in zip(requests, tasks, strict=True)
                                   if not t.done()], return_exceptions=True)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


class ClientGone(Exception):
    """The HTTP client disconnected before the response was complete."""


_CLEANUPS: set[asyncio.Task[None]] = set()


def _close_in_background(it: AsyncIterator[object], step: asyncio.Future[object] | None) -> None:
    """Finish ``step`` (cancelled) and close ``it`` in a task of its own, so that the caller's
    response (a 408, a closed stream) is not held up by the aborts that closing sends to the
    workers; the task is kept referenced until it ends."""
    async def cleanup() -> None:
        started = time.monotonic()
        if step is not None and not step.done():
            step.cancel()
            await asyncio.gather(step, return_exceptions=True)
        try:
            await _close(it)
        except Exception:  # closing must not raise into the loop's exception handler
            log.exception("closing an abandoned request stream failed")
        if time.monotonic() - started > 5:
            log.warning("closing an abandoned request stream took %.1f s", time.monotonic() - started)

    task = asyncio.get_running_loop().create_task(cleanup())
    _CLEANUPS.add(task)
    task.add_done_callback(_CLEANUPS.discard)


async def guarded(it: AsyncIterator[T], deadline: float, disconnected: Callable[[], Awaitable[bool]],
                  poll_seconds: float = 0.5) -> AsyncGenerator[T, None]:
    """Yield from ``it``; past ``deadline`` (monotonic) raise TimeoutError, and when the client has
    gone raise ClientGone. ``it`` is closed either way: at once when it ran to its end, and in the
    background when it was abandoned (deadline, client gone, consumer closed this generator early),
    so the abandoning side never waits on the workers' aborts."""
    step: asyncio.Future[T] | None = None
    try:
        while True:
            step = asyncio.ensure_future(anext(it))
            while not step.done():
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError
                await asyncio.wait({step}, timeout=min(poll_seconds, left))
                if not step.done() and await disconnected():
                    raise ClientGone
            try:
                item = step.result()
            except StopAsyncIteration:
                step = None
                await _close(it)
                return
            step = None
            yield item
    except BaseException:
        _close_in_background(it, step)  # type: ignore[arg-type]
        raise


def sse(payload: msgspec.Struct | dict[str, object]) -> bytes:
    """One server-sent event: ``data: <json>`` and a blank line."""
    return b"data: " + msgspec.json.encode(payload) + b"\n\n"

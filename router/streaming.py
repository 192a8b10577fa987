"""From token batches to text: incremental detokenization, stop strings, fan-in of ``n`` choices.

Contracts:

* ``StopFilter`` never emits any part of a stop string: text that could still
  grow into one (the longest suffix that is a prefix of some stop string) is
  held back until the next piece decides it, and the text from the earliest
  match onwards is dropped.
* ``ChoiceDecoder`` feeds tokens one by one, so a stop string ends the choice at
  the token that completes it; ``num_tokens`` counts the tokens consumed up to
  and including that one.
* ``merge_choices`` reads every choice's stream at once (one pending read each,
  no task or queue of its own), under the request's deadline and while the HTTP
  client is there, and closes every stream however it ends (finished, stop
  string, error, deadline, client gone, closed early), so an unfinished request
  is aborted on every worker (``PDClient.generate`` sends the aborts when its
  stream closes). An abandoned stream is closed in the background, so the
  answer (a 408, a closed connection) never waits on the workers' aborts.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from engine.tokenizer import IncrementalDetokenizer, Tokenizer
from messages.wire import ErrorKind, TokenBatch, TokenLogprob
from router.errors import ClientGone, RequestFailed

log = logging.getLogger(__name__)


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


Step = asyncio.Future[TokenBatch]


async def merge_choices(streams: Sequence[AsyncIterator[TokenBatch]], decoders: Sequence[ChoiceDecoder],
                        deadline: float, disconnected: Callable[[], Awaitable[bool]],
                        poll_seconds: float = 0.5) -> AsyncGenerator[ChoiceDelta, None]:
    """Each choice's deltas as its batches come (``streams[i]`` decoded by ``decoders[i]``), until every
    choice has finished. Past ``deadline`` (monotonic) raises TimeoutError; when the HTTP client has gone
    (``disconnected``, asked every ``poll_seconds`` without output) raises ``ClientGone``; a stream
    that fails raises its error, one that ends unfinished or aborted ``RequestFailed(aborted)``."""
    reads: dict[Step, int] = {asyncio.ensure_future(anext(it)): i for i, it in enumerate(streams)}
    unclosed = set(range(len(streams)))
    try:
        while reads:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            done, _ = await asyncio.wait(reads, timeout=min(poll_seconds, left),
                                         return_when=asyncio.FIRST_COMPLETED)
            if not done and await disconnected():
                raise ClientGone
            for read in sorted(done, key=reads.__getitem__):
                i = reads.pop(read)
                try:
                    batch = read.result()
                except StopAsyncIteration:
                    raise RequestFailed(ErrorKind.ABORTED, "a choice's stream ended before its last token") \
                        from None
                delta = decoders[i].feed(batch)
                if delta.finish_reason == "abort":
                    raise RequestFailed(ErrorKind.ABORTED, f"request {batch.request_id} was aborted by the "
                                                           f"server")
                if delta.finish_reason is None:
                    reads[asyncio.ensure_future(anext(streams[i]))] = i
                    yield delta
                    continue
                unclosed.discard(i)
                if batch.finished:
                    await _close(streams[i])  # it has nothing left to abort
                else:  # a stop string ended the choice: the request still runs on its worker
                    _close_in_background(streams[i], None)
                yield delta
    except BaseException:
        pending = {i: read for read, i in reads.items()}
        for i in unclosed:
            _close_in_background(streams[i], pending.get(i))
        raise


async def _close(it: AsyncIterator[object]) -> None:
    aclose: Callable[[], Awaitable[None]] | None = getattr(it, "aclose", None)
    if aclose is not None:
        await aclose()


_CLEANUPS: set[asyncio.Task[None]] = set()


def _close_in_background(it: AsyncIterator[object], read: Step | None) -> None:
    """Cancel ``read`` (a pending read of ``it``) and close ``it`` in a task of its own, so that the
    caller's answer is not held up by the aborts that closing sends to the workers; the task is kept
    referenced until it ends."""
    async def cleanup() -> None:
        started = time.monotonic()
        if read is not None and not read.done():
            read.cancel()
        if read is not None:
            await asyncio.gather(read, return_exceptions=True)
        try:
            await _close(it)
        except Exception:  # closing must not raise into the loop's exception handler
            log.exception("closing an abandoned request stream failed")
        if time.monotonic() - started > 5:
            log.warning("closing an abandoned request stream took %.1f s", time.monotonic() - started)

    task = asyncio.get_running_loop().create_task(cleanup())
    _CLEANUPS.add(task)
    task.add_done_callback(_CLEANUPS.discard)

"""OutputChannel: the router's end of one decode worker's output channel (the worker's is
``decode/outbox.py``).

One Ray stream per decode worker (``DecodeWorker.outputs``) carries ``OutputFrame``s; a reader task
hands each frame's items to the ``AttemptOutputs`` they belong to (their ``stream`` number), the one
queue a token batch passes in the router. An attempt (``open``) gets a number and its outputs; the
caller then starts it with ``DecodeWorker.submit`` under the channel's name and that number
(``watch``ing the call), reads its items with ``AttemptOutputs.next`` and ``close``s it when done.

Failure: when the channel's Ray stream fails (the worker died or cannot be reached) every attempt
open on it gets that exception from ``next``, as each would have from a stream of its own (the caller
acts on ``router.handles.WORKER_DIED``); the next ``open`` starts a new channel under a new name (a
restarted worker's first). An attempt whose ``submit`` call raised gets that exception (``watch``).
The reader's end (``close``, or its event loop closing) cancels the worker's end; ``close(error)``
gives the attempts still open that error (the worker table passes a ``WORKER_DIED`` one when a worker
leaves with requests still running, so they migrate as from a dead worker).
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from concurrent.futures import Future
from typing import Any

import ray

from messages.codec import unpack
from messages.wire import OutputFrame, TokenBatch, WorkerError

Streamed = TokenBatch | WorkerError


class AttemptOutputs:
    """One attempt's items, in order: token batches up to the finished one, or one ``WorkerError``."""

    def __init__(self, channel: OutputChannel, number: int, item_timeout: float) -> None:
        self.channel = channel
        self.number = number
        self.item_timeout = item_timeout
        self._queue: asyncio.Queue[Streamed | BaseException] = asyncio.Queue()
        self._ahead: Streamed | None = None

    async def next(self) -> Streamed:
        """The next item; raises what ended the channel or the ``submit`` call (Ray's error when the
        worker died), and TimeoutError when none arrives within ``item_timeout`` seconds."""
        if self._ahead is not None:
            item, self._ahead = self._ahead, None
            return item
        async with asyncio.timeout(self.item_timeout):
            got = await self._queue.get()
        if isinstance(got, BaseException):
            raise got
        return got

    def unread(self, item: Streamed) -> None:
        """Make ``item`` (read to look at it) the next ``next`` again."""
        self._ahead = item

    def put(self, item: Streamed | BaseException) -> None:
        self._queue.put_nowait(item)

    def watch(self, call: Any) -> None:
        """Fail the attempt when ``call``, the Ray call that started it, raises (the worker died, or a
        bug there): its items would never come."""
        loop = asyncio.get_running_loop()

        def failed(future: Future[Any]) -> None:
            exc = future.exception() if not future.cancelled() else None
            if exc is not None:
                with contextlib.suppress(RuntimeError):  # the loop has closed: nobody reads the queue
                    loop.call_soon_threadsafe(self.put, exc)

        call.future().add_done_callback(failed)

    def close(self) -> None:
        """The attempt is done with its items (those still arriving are dropped); idempotent."""
        self.channel.release(self.number)


class OutputChannel:
    def __init__(self, actor: Any) -> None:
        self.actor = actor
        self.name = ""
        self._attempts: dict[int, AttemptOutputs] = {}
        self._next = 0
        self._reader: asyncio.Task[None] | None = None
        self._close_error: BaseException | None = None
        self.frames = 0
        self.items = 0

    def open(self, item_timeout: float) -> AttemptOutputs:
        """A new attempt on this channel (started first if it is not running): its number and items."""
        if self._reader is None or self._reader.done():
            self.name = uuid.uuid4().hex
            self._attempts = {}  # the attempts of this channel alone: a closed one's reader fails its own
            stream = self.actor.outputs.options(num_returns="streaming").remote(self.name)
            self._reader = asyncio.get_running_loop().create_task(self._read(stream, self.name,
                                                                             self._attempts))
        self._next += 1
        outputs = self._attempts[self._next] = AttemptOutputs(self, self._next, item_timeout)
        return outputs

    def release(self, stream: int) -> None:
        """Attempt ``stream`` is done with its items (those still arriving for it are dropped)."""
        self._attempts.pop(stream, None)

    async def _read(self, stream: Any, name: str, attempts: dict[int, AttemptOutputs]) -> None:
        error: BaseException = RuntimeError(f"the decode worker ended output channel {name}")
        try:
            async for ref in stream:
                frame = unpack(await ref, OutputFrame)
                self.frames += 1
                self.items += len(frame.items)
                for it in frame.items:
                    outputs = attempts.get(it.stream)
                    if outputs is not None:
                        outputs.put(it.item)
        except asyncio.CancelledError:
            error = self._close_error or RuntimeError(f"output channel {name} closed")
            raise
        except Exception as exc:  # the worker's death (Ray's error) reaches every open attempt
            error = exc
        finally:
            for outputs in attempts.values():
                outputs.put(error)
            attempts.clear()
            with contextlib.suppress(Exception):  # the worker's end stops too (a no-op once it failed)
                ray.cancel(stream)

    def close(self, error: BaseException | None = None) -> None:
        """Stop reading: every open attempt gets ``error`` (default: a ``RuntimeError``), and the worker's
        end is cancelled (its ``outputs`` call ends)."""
        if self._reader is not None:
            self._close_error = error
            self._reader.cancel()
            self._reader = None

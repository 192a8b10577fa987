"""OutputChannel: the router's end of one decode worker's output channel (the worker's is
``decode/outbox.py``).

One Ray stream per decode worker (``DecodeWorker.outputs``) carries ``OutputFrame``s; a reader task
hands each frame's items to the queue of the attempt they belong to (their ``stream`` number). An
attempt (``open``) gets a number and a queue; the caller then starts it with ``DecodeWorker.submit``
under the channel's name and that number, and reads the queue.

Failure: when the channel's Ray stream fails (the worker died or cannot be reached) every attempt
open on it gets that exception in its queue, as each would have from a stream of its own (the caller
acts on ``router.handles.WORKER_DIED``); the next ``open`` starts a new channel under a new name (a
restarted worker's first). ``fail(stream, exc)`` puts an error for one attempt (its ``submit`` call
raised). The reader's end (``close``, or its event loop closing) cancels the worker's end; ``close(error)``
gives the attempts still open that error (the worker table passes a ``WORKER_DIED`` one when a worker
leaves with requests still running, so they migrate as from a dead worker).
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from typing import Any

import ray

from messages.codec import unpack
from messages.wire import OutputFrame, TokenBatch, WorkerError

Received = TokenBatch | WorkerError | BaseException


class OutputChannel:
    def __init__(self, actor: Any) -> None:
        self.actor = actor
        self.name = ""
        self._queues: dict[int, asyncio.Queue[Received]] = {}
        self._next = 0
        self._reader: asyncio.Task[None] | None = None
        self._close_error: BaseException | None = None
        self.frames = 0
        self.items = 0

    def open(self) -> tuple[int, asyncio.Queue[Received]]:
        """A new attempt's number on this channel (started first if it is not running) and its queue."""
        if self._reader is None or self._reader.done():
            self.name = uuid.uuid4().hex
            self._queues = {}  # the attempts of this channel alone: a closed one's reader fails its own
            stream = self.actor.outputs.options(num_returns="streaming").remote(self.name)
            self._reader = asyncio.get_running_loop().create_task(self._read(stream, self.name, self._queues))
        self._next += 1
        queue: asyncio.Queue[Received] = asyncio.Queue()
        self._queues[self._next] = queue
        return self._next, queue

    def release(self, stream: int) -> None:
        """The attempt is done with its queue (items still arriving for it are dropped)."""
        self._queues.pop(stream, None)

    def fail(self, stream: int, exc: BaseException) -> None:
        queue = self._queues.get(stream)
        if queue is not None:
            queue.put_nowait(exc)

    async def _read(self, stream: Any, name: str, queues: dict[int, asyncio.Queue[Received]]) -> None:
        error: BaseException = RuntimeError(f"the decode worker ended output channel {name}")
        try:
            async for ref in stream:
                frame = unpack(await ref, OutputFrame)
                self.frames += 1
                self.items += len(frame.items)
                for it in frame.items:
                    queue = queues.get(it.stream)
                    if queue is not None:
                        queue.put_nowait(it.item)
        except asyncio.CancelledError:
            error = self._close_error or RuntimeError(f"output channel {name} closed")
            raise
        except Exception as exc:  # the worker's death (Ray's error) reaches every open attempt
            error = exc
        finally:
            for queue in queues.values():
                queue.put_nowait(error)
            queues.clear()
            with contextlib.suppress(Exception):  # the worker's end stops too (a no-op once it failed)
                ray.cancel(stream)

    def close(self, error: BaseException | None = None) -> None:
        """Stop reading: every open attempt gets ``error`` (default: a ``RuntimeError``), and the worker's
        end is cancelled (its ``outputs`` call ends)."""
        if self._reader is not None:
            self._close_error = error
            self._reader.cancel()
            self._reader = None

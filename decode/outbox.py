"""Outbox: a decode worker's output channels, the worker's end (the router's is ``router.channel``).

Why: every Ray stream item costs CPU in the worker and in the router (gRPC, object bookkeeping), on
the cores the engine computes on, and one stream per request would send one item per request per
engine step. A channel carries every item made in one turn of the worker's event loop as one
``OutputFrame``: one Ray item a step, whatever the batch (figures: docs/benchmarks.md, "One output
channel per decode worker").

Contract:

* ``put(channel, stream, item)``: queue an attempt's item (a ``TokenBatch`` or ``WorkerError``) for
  the channel, tagged with the attempt's ``stream`` number. Items of one stream keep their order.
* ``frames(channel)``: the channel's reader; yields a frame each time items are waiting, with all of
  them, in the order they were put. Items put before the reader starts wait for it (a router
  submits its first attempt right after opening the channel, and the two calls may start in either
  order). One reader per channel.
* Once a channel's reader ends (the router cancelled it, or went away), the channel is closed: what
  it held is dropped and later ``put``s to it are dropped too (nobody will read them; the router
  aborts its requests on its side).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field

from messages.wire import OutputFrame, StreamItem, TokenBatch, WorkerError


@dataclass
class _Channel:
    items: list[StreamItem] = field(default_factory=list)
    ready: asyncio.Event = field(default_factory=asyncio.Event)


class Outbox:
    def __init__(self) -> None:
        self._channels: dict[str, _Channel] = {}
        self._closed: set[str] = set()
        self.frames_sent = 0
        self.items_sent = 0

    def put(self, channel: str, stream: int, item: TokenBatch | WorkerError) -> None:
        if channel in self._closed:
            return
        ch = self._channels.setdefault(channel, _Channel())
        ch.items.append(StreamItem(stream, item))
        ch.ready.set()

    async def frames(self, channel: str) -> AsyncGenerator[OutputFrame, None]:
        ch = self._channels.setdefault(channel, _Channel())
        try:
            while True:
                await ch.ready.wait()
                ch.ready.clear()
                items, ch.items = ch.items, []
                self.frames_sent += 1
                self.items_sent += len(items)
                yield OutputFrame(items)
        finally:
            self._closed.add(channel)
            self._channels.pop(channel, None)

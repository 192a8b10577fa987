"""One attempt on an in-process ``DecodeWorker`` the way the router runs it: ``submit`` on an output
channel of its own, its items read back from ``outputs`` up to the last (a finished batch or an error)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

from decode.worker import DecodeWorker
from messages.codec import pack, unpack
from messages.wire import GenerateRequest, OutputFrame, TokenBatch, WorkerError


async def attempt_items(worker: DecodeWorker, req: GenerateRequest,
                        prefill: list[Any] | None = None) -> AsyncIterator[TokenBatch | WorkerError]:
    channel = uuid.uuid4().hex
    frames = worker.outputs(channel)
    submit = asyncio.create_task(worker.submit(channel, 1, pack(req), prefill))
    try:
        async for data in frames:
            for entry in unpack(data, OutputFrame).items:
                assert entry.stream == 1
                yield entry.item
                if isinstance(entry.item, WorkerError) or entry.item.finished:
                    return
    finally:
        await frames.aclose()
        await submit

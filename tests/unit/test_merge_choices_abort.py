"""Closing ``merge_choices`` early aborts its unfinished requests before it waits for their reads.

The backend here streams like a Ray stream read: a pending read does not give way to cancellation;
it ends only when the next item arrives or the request ends, and a request ends only when it finishes
or is aborted. Closing the merged stream must therefore abort first; if it cancelled the reads and
waited for them before aborting (as it once did), the close would wait for the requests to run out
(here: forever; on a server: a decode worker generating for nobody, holding its KV).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator

from engine.tokenizer import Tokenizer
from messages.wire import GenerateRequest, SamplingParams, TokenBatch
from router.streaming import ChoiceDecoder, merge_choices


class CharTokenizer(Tokenizer):
    """Token i is chr(i): enough for the decoder to turn tokens into text."""

    def __init__(self) -> None:
        pass

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:  # type: ignore[override]
        return "".join(chr(t) for t in token_ids)


class UnyieldingBackend:
    """Each request yields one batch; its next read ends only when the request ends (``abort``), not
    when cancelled, as a read of a Ray stream waits for the item it asked for; an unfinished stream
    aborts its request when it closes, as ``PDClient.generate`` does."""

    model_name = "test"

    def __init__(self) -> None:
        self.ended: dict[str, asyncio.Event] = {}
        self.aborted: list[str] = []

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)
        self.ended.setdefault(request_id, asyncio.Event()).set()

    async def generate(self, req: GenerateRequest) -> AsyncIterator[TokenBatch]:
        ended = self.ended.setdefault(req.request_id, asyncio.Event())
        finished = False
        try:
            yield TokenBatch(request_id=req.request_id, token_ids=[ord("a")], finished=False)
            while not ended.is_set():
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.shield(ended.wait())
            finished = True
            yield TokenBatch(request_id=req.request_id, token_ids=[], finished=True, finish_reason="abort")
        finally:
            if not finished:
                await self.abort(req.request_id)


def test_closing_early_aborts_before_waiting_for_the_reads() -> None:
    backend = UnyieldingBackend()
    requests = [GenerateRequest(request_id=f"r{i}", prompt_token_ids=[1, 2, 3],
                                sampling=SamplingParams(max_tokens=100)) for i in range(3)]
    decoders = [ChoiceDecoder(i, CharTokenizer(), []) for i in range(3)]

    async def consume_then_leave() -> list[str]:
        merged = merge_choices(backend, requests, decoders)  # type: ignore[arg-type]
        first = await anext(merged)
        await merged.aclose()  # hangs without the abort-first close
        return [first.text]

    result: dict[str, list[str]] = {}
    thread = threading.Thread(target=lambda: result.update(texts=asyncio.run(consume_then_leave())),
                              daemon=True)
    thread.start()
    thread.join(10)
    assert not thread.is_alive(), "closing the merged stream hung: it waited for the reads before aborting"
    assert result["texts"] == ["a"]
    assert sorted(set(backend.aborted)) == ["r0", "r1", "r2"]

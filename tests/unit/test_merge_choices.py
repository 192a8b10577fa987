"""``merge_choices``: every choice's stream read at once, deltas as they come, and every stream closed
however the merge ends, the abandoned ones in the background (the answer never waits on the aborts).

The streams stand in for ``PDClient.generate``: a batch, then reads that wait for the request to end,
and, closed unfinished, an abort of their request (here one that takes as long as the test says)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest

from engine.tokenizer import Tokenizer
from messages.wire import TokenBatch
from router.errors import ClientGone, RequestFailed
from router.streaming import ChoiceDecoder, merge_choices


class CharTokenizer(Tokenizer):
    """Token i is chr(i): enough for the decoder to turn tokens into text."""

    def __init__(self) -> None:
        pass

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:  # type: ignore[override]
        return "".join(chr(t) for t in token_ids)


class Requests:
    """Streams of requests that yield ``text`` and then wait, or finish when ``finish`` says so; an
    unfinished stream closed aborts its request once the ``aborts_go`` event is set."""

    def __init__(self) -> None:
        self.aborted: list[str] = []
        self.aborts_go = asyncio.Event()
        self.aborts_go.set()

    async def stream(self, rid: str, text: str, finish: bool = False) -> AsyncIterator[TokenBatch]:
        finished = finish  # as PDClient.generate: set before the last batch is handed out
        try:
            yield TokenBatch(request_id=rid, token_ids=[ord(c) for c in text], finished=finish)
            await asyncio.Event().wait()  # the request runs on, producing nothing more
        finally:
            if not finished:
                await self.aborts_go.wait()
                self.aborted.append(rid)

    async def until(self, aborted: list[str]) -> None:
        while sorted(self.aborted) != aborted:
            await asyncio.sleep(0.01)


async def never_gone() -> bool:
    return False


def decoders(n: int, stops: list[str] | None = None) -> list[ChoiceDecoder]:
    return [ChoiceDecoder(i, CharTokenizer(), stops or []) for i in range(n)]


def test_closed_early_it_returns_at_once_and_every_unfinished_request_is_aborted_once() -> None:
    async def run() -> list[str]:
        r = Requests()
        r.aborts_go.clear()  # the aborts take until the merge has been closed
        merged = merge_choices([r.stream(f"r{i}", "a") for i in range(3)], decoders(3),
                               time.monotonic() + 60, never_gone)
        first = await anext(merged)
        await asyncio.wait_for(merged.aclose(), 10)  # waiting for the aborts would never end
        assert r.aborted == []
        r.aborts_go.set()
        await asyncio.wait_for(r.until(["r0", "r1", "r2"]), 10)
        return [first.text]

    assert asyncio.run(run()) == ["a"]


def test_a_stop_string_ends_its_choice_and_aborts_its_request() -> None:
    async def run() -> tuple[list[tuple[int, str, str | None]], list[str]]:
        r = Requests()
        streams = [r.stream("r0", "xyz"), r.stream("r1", "done", finish=True)]
        merged = merge_choices(streams, decoders(2, stops=["y"]), time.monotonic() + 60, never_gone)
        deltas = [(d.index, d.text, d.finish_reason) async for d in merged]
        await asyncio.wait_for(r.until(["r0"]), 10)
        return deltas, r.aborted

    deltas, aborted = asyncio.run(run())
    assert deltas == [(0, "x", "stop"), (1, "done", "stop")]
    assert aborted == ["r0"]  # the finished request is not aborted


def test_past_the_deadline_it_raises_and_aborts() -> None:
    async def run() -> list[str]:
        r = Requests()
        merged = merge_choices([r.stream("r0", "a")], decoders(1), time.monotonic() + 0.2, never_gone,
                               poll_seconds=0.05)
        assert (await anext(merged)).text == "a"
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(anext(merged), 10)
        await asyncio.wait_for(r.until(["r0"]), 10)
        return r.aborted

    assert asyncio.run(run()) == ["r0"]


def test_a_client_gone_is_noticed_while_nothing_comes() -> None:
    async def run() -> list[str]:
        r = Requests()
        asked: list[int] = []

        async def gone() -> bool:
            asked.append(1)
            return len(asked) >= 2

        merged = merge_choices([r.stream("r0", "a")], decoders(1), time.monotonic() + 60, gone,
                               poll_seconds=0.01)
        await anext(merged)
        with pytest.raises(ClientGone):
            await asyncio.wait_for(anext(merged), 10)
        await asyncio.wait_for(r.until(["r0"]), 10)
        return r.aborted

    assert asyncio.run(run()) == ["r0"]


def test_a_stream_that_ends_unfinished_fails_the_request() -> None:
    async def cut_short() -> AsyncIterator[TokenBatch]:
        yield TokenBatch(request_id="r0", token_ids=[ord("a")], finished=False)

    async def run() -> None:
        merged = merge_choices([cut_short()], decoders(1), time.monotonic() + 60, never_gone)
        await anext(merged)
        with pytest.raises(RequestFailed, match="ended before its last token"):
            await anext(merged)

    asyncio.run(run())

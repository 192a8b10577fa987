"""The decode worker's end of an output channel (``decode/outbox.py``): one frame per event-loop turn,
items in order, items before the reader kept, a closed channel dropping what comes after."""

from __future__ import annotations

import asyncio

from decode.outbox import Outbox
from messages.codec import pack, unpack
from messages.wire import ErrorKind, OutputFrame, StreamItem, TokenBatch, WorkerError


def batch(rid: str, token: int, finished: bool = False) -> TokenBatch:
    return TokenBatch(request_id=rid, token_ids=[token], finished=finished)


def test_items_of_one_turn_go_in_one_frame_in_order() -> None:
    async def flow() -> list[OutputFrame]:
        box = Outbox()
        box.put("c", 1, batch("a", 10))  # before the reader starts: kept for it
        frames = box.frames("c")
        first = await anext(frames)

        async def producer(stream: int, rid: str) -> None:
            for token in range(3):
                box.put("c", stream, batch(rid, token, finished=token == 2))
                await asyncio.sleep(0)  # one item per turn, as a request gets one per engine step

        tasks = [asyncio.create_task(producer(s, f"r{s}")) for s in (2, 3, 4)]
        got = [first] + [await anext(frames) for _ in range(3)]
        await asyncio.gather(*tasks)
        await frames.aclose()
        assert (box.frames_sent, box.items_sent) == (4, 10)
        return got

    frames = asyncio.run(flow())
    assert frames[0] == OutputFrame([StreamItem(1, batch("a", 10))])
    for token, frame in enumerate(frames[1:]):  # the three requests' items of a turn share its frame
        assert frame.items == [StreamItem(s, batch(f"r{s}", token, token == 2)) for s in (2, 3, 4)]


def test_frames_round_trip_the_wire_with_errors_beside_batches() -> None:
    frame = OutputFrame([StreamItem(7, batch("a", 1)), StreamItem(8, WorkerError(ErrorKind.NO_KV, "full"))])
    assert unpack(pack(frame), OutputFrame) == frame


def test_a_closed_channel_drops_later_items_and_others_go_on() -> None:
    async def flow() -> None:
        box = Outbox()
        gone, kept = box.frames("gone"), box.frames("kept")
        box.put("gone", 1, batch("a", 1))
        box.put("kept", 1, batch("b", 1))
        assert (await anext(gone)).items == [StreamItem(1, batch("a", 1))]
        await gone.aclose()  # the router cancelled the channel
        box.put("gone", 1, batch("a", 2))
        box.put("kept", 1, batch("b", 2))
        assert [i.item for i in (await anext(kept)).items] == [batch("b", 1), batch("b", 2)]
        assert "gone" not in box._channels  # nothing kept for a reader that will not come back
        await kept.aclose()

    asyncio.run(flow())

"""A prefilled request starts decoding at the first step boundary after its prefill answers.

A decode worker that is busy stepping other requests gets a ``PrefillResult`` mid-step. It pulls the
missing blocks (NIXL, while the step runs: the blocks are its reservation's, no running request touches
them) and starts the request between the running step and the next, where its first token goes out. It
used to read its reservation's block ids under the engine's lock first: that waited for the running
step, and by the time the pull was done the engine loop had started the next step, which the start then
waited for too: a whole extra decode step (130 ms a token at this machine's batch) in every prefilled
request's time to first token. Real prefill and decode workers here, in one process, with a real NIXL
pull. The test holds one decode step open, answers the prefill while it is held, lets it end once the
pull is done, and checks by order, not by time, that no step began before the request started.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import pytest

from decode.worker import DecodeWorker
from engine.config import EngineConfig
from engine.sampling_params import SamplingParams
from messages.codec import pack, unpack
from messages.wire import GenerateRequest, TokenBatch, WorkerStats
from prefill.worker import PrefillWorker
from tests.unit.decode_attempts import attempt_items
from tests.waiting import until

WAIT_S = 30.0  # bounds a hang only


def test_a_prefilled_request_joins_at_the_next_step_boundary(tiny_model_dir: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    config = EngineConfig(num_kv_blocks=64, block_size=16, max_num_seqs=8)
    prefill = PrefillWorker("prefill-h", str(tiny_model_dir), pack(config))
    decode = DecodeWorker("decode-h", str(tiny_model_dir), pack(config))
    steps_begun = [0]  # decode steps begun so far (engine thread)
    open_gate = threading.Event()  # cleared: the next step to begin waits for it
    open_gate.set()
    starts: list[int] = []  # steps begun when the prefilled request started
    pulls: list[int] = []  # steps begun when its pull ended
    real_step, real_start, real_read = decode.engine.step, decode.engine.start_prefilled, decode.sink.read

    def held_step() -> Any:
        steps_begun[0] += 1
        assert open_gate.wait(WAIT_S), "a decode step held past the test's wait"
        return real_step()

    def start_prefilled(*args: Any, **kwargs: Any) -> Any:
        starts.append(steps_begun[0])
        return real_start(*args, **kwargs)

    async def read(*args: Any, **kwargs: Any) -> Any:
        stats = await real_read(*args, **kwargs)
        pulls.append(steps_begun[0])
        return stats

    monkeypatch.setattr(decode.engine, "step", held_step)
    monkeypatch.setattr(decode.engine, "start_prefilled", start_prefilled)
    monkeypatch.setattr(decode.sink, "read", read)
    busy = GenerateRequest(request_id="busy", prompt_token_ids=list(range(1, 21)),
                           sampling=SamplingParams(max_tokens=100_000, temperature=0.0, ignore_eos=True))
    req = GenerateRequest(request_id="late", prompt_token_ids=list(range(30, 70)),
                          sampling=SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))

    async def consume(gen: Any) -> list[int]:
        tokens: list[int] = []
        async for item in gen:
            assert isinstance(item, TokenBatch), item
            tokens.extend(item.token_ids)
        return tokens

    async def main() -> tuple[int, list[int]]:
        await decode.ready()
        assert await decode.connect(await prefill.ready()) == b""
        other = asyncio.create_task(consume(attempt_items(decode, busy)))
        result = await prefill.prefill(pack(req))  # computed before the decode side asks for it
        answer: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        late = asyncio.create_task(consume(attempt_items(decode, req, [answer])))

        async def reserved() -> bool:  # the late request holds its blocks; the busy one decodes
            stats = unpack(await decode.stats(), WorkerStats)
            return stats.requests.reserved == 1 and stats.requests.running == 1

        await until(reserved, WAIT_S, "the late request reserved beside the busy one")
        open_gate.clear()
        before = steps_begun[0]

        async def held() -> bool:
            return steps_begun[0] > before

        await until(held, WAIT_S, "a decode step beginning")
        held_at = steps_begun[0]
        answer.set_result(result)  # the prefill answers while that step runs

        async def pulled() -> bool:
            return bool(pulls)

        await until(pulled, WAIT_S, "the pull ending while the decode step runs")
        open_gate.set()
        tokens = await asyncio.wait_for(late, WAIT_S)
        await decode.abort(busy.request_id)
        await asyncio.wait_for(other, WAIT_S)
        await decode.aengine.stop()
        await prefill.aengine.stop()
        return held_at, tokens

    held_at, tokens = asyncio.run(main())
    assert len(tokens) == 6
    assert pulls == [held_at]  # pulled while the held step ran
    assert starts == [held_at]  # started before another step began: its first token went out there

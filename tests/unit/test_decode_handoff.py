"""A prefilled request starts decoding at the first step boundary after its prefill answers.

A decode worker that is busy stepping other requests gets a ``PrefillResult`` mid-step. It pulls the
missing blocks (NIXL, while the step runs: the blocks are its reservation's, no running request touches
them) and starts the request between the running step and the next, where its first token goes out.
Reading the reservation's block ids under the engine's lock first would wait for the running step, and
by the time the pull was done the engine loop would have started the next one: a whole extra decode
step in every prefilled request's time to first token. Real prefill and decode workers here, in one
process, with a real NIXL pull, given the time a pull between two processes takes (``PULL_S``; one in a
process can end without a poll); each decode step is held ``STEP_S`` so the pull ends well inside the
step it starts in.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from decode.worker import DecodeWorker
from engine.config import EngineConfig
from engine.sampling_params import SamplingParams
from messages.codec import pack
from messages.wire import GenerateRequest, TokenBatch
from prefill.worker import PrefillWorker
from tests.unit.decode_attempts import attempt_items

STEP_S = 0.1
PULL_S = 0.02  # a pull between processes takes polls; one in this process can end at once


def test_a_prefilled_request_joins_at_the_next_step_boundary(tiny_model_dir: Path) -> None:
    config = EngineConfig(num_kv_blocks=64, block_size=16, max_num_seqs=8)
    prefill = PrefillWorker("prefill-h", str(tiny_model_dir), pack(config))
    decode = DecodeWorker("decode-h", str(tiny_model_dir), pack(config))
    started: list[float] = []  # when each decode step began
    real_step = decode.engine.step

    def slow_step() -> Any:
        started.append(time.monotonic())
        time.sleep(STEP_S)
        return real_step()

    decode.engine.step = slow_step  # type: ignore[method-assign]
    real_read = decode.sink.read

    async def read(*args: Any, **kwargs: Any) -> Any:
        await asyncio.sleep(PULL_S)
        return await real_read(*args, **kwargs)

    decode.sink.read = read  # type: ignore[method-assign]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    busy = GenerateRequest(request_id="busy", prompt_token_ids=list(range(1, 21)),
                           sampling=SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    req = GenerateRequest(request_id="late", prompt_token_ids=list(range(30, 70)), sampling=params)

    async def consume(gen: Any) -> list[int]:
        tokens: list[int] = []
        async for item in gen:
            assert isinstance(item, TokenBatch), item
            tokens.extend(item.token_ids)
        return tokens

    async def main() -> tuple[float, float, list[int]]:
        await decode.ready()
        assert await decode.connect(await prefill.ready()) == b""
        other = asyncio.create_task(consume(attempt_items(decode, busy)))
        result = await prefill.prefill(pack(req))  # computed before the decode side asks for it
        answer: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        first_at: list[float] = []
        tokens: list[int] = []

        async def late() -> None:
            async for item in attempt_items(decode, req, [answer]):
                assert isinstance(item, TokenBatch), item
                if not first_at:
                    first_at.append(time.monotonic())
                tokens.extend(item.token_ids)

        task = asyncio.create_task(late())
        while len(started) < 4:  # the busy request decoding, the late one reserved
            await asyncio.sleep(0.01)
        n = len(started)
        while len(started) == n:  # the prefill answers just after a step began
            await asyncio.sleep(0.005)
        answered = time.monotonic()
        answer.set_result(result)
        await asyncio.wait_for(asyncio.gather(task, other), 60)
        await decode.aengine.stop()
        await prefill.aengine.stop()
        return answered, first_at[0], tokens

    answered, first, tokens = asyncio.run(main())
    assert len(tokens) == 6
    # no decode step began between the answer and the first token: it went out at the end of the step
    # running when the prefill answered
    between = [t for t in started if answered < t < first]
    assert between == [], f"{len(between)} decode step(s) began before the first token"
    assert first - answered < STEP_S + 0.1

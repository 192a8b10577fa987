"""An engine is built, stepped, read and mutated on its one ``EngineThread``, never on the event loop's.

libgomp keeps a thread team per thread that opens a parallel region; a worker whose engine ran on two
threads held two teams on two CPUs, and every barrier of the one-call decoder then slept in the kernel
(engine/async_engine.py, "One engine thread"). The thread also carries torch's thread count and the
caller's context variables (a span opened in a mutation keeps its trace).
"""

from __future__ import annotations

import asyncio
import contextvars
import threading
from pathlib import Path

import pytest
import torch

from engine.async_engine import AsyncEngine, EngineThread
from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams

TAG: contextvars.ContextVar[str] = contextvars.ContextVar("TAG", default="unset")


def test_every_engine_call_runs_on_the_engine_thread(tiny_model_dir: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, set[int]] = {"build": set(), "step": set(), "read": set(), "mutate": set()}
    thread = EngineThread(num_threads=1)

    def build() -> LLMEngine:
        seen["build"].add(threading.get_ident())
        return LLMEngine(str(tiny_model_dir), EngineConfig(num_kv_blocks=64, block_size=16, max_num_seqs=4))

    engine = thread.call(build)
    real_step = engine.step

    def step() -> list[RequestOutput]:
        seen["step"].add(threading.get_ident())
        return real_step()

    monkeypatch.setattr(engine, "step", step)
    aengine = AsyncEngine(engine, thread)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)

    async def main() -> tuple[int, str, int]:
        TAG.set("request r")

        def add(e: LLMEngine) -> str:
            seen["mutate"].add(threading.get_ident())
            e.add_request(list(range(1, 9)), params, request_id="r")
            aengine.open_stream("r")
            return TAG.get()

        tag = await aengine.mutate(add)
        tokens = 0
        async for batch in aengine.stream("r", 60.0):
            tokens += sum(len(o.new_token_ids) for o in batch)

        def threads(e: LLMEngine) -> int:
            seen["read"].add(threading.get_ident())
            return torch.get_num_threads()

        n = await aengine.read(threads)
        await aengine.stop()
        return tokens, tag, n

    loop_thread = threading.get_ident()
    tokens, tag, num_threads = asyncio.run(main())
    thread.close()
    assert tokens == 4
    assert tag == "request r"
    assert num_threads == 1
    idents = set().union(*seen.values())
    assert all(seen.values()) and len(idents) == 1, seen
    assert loop_thread not in idents


def test_an_engine_made_without_a_thread_gets_its_own(tiny_model_dir: Path) -> None:
    engine = LLMEngine(str(tiny_model_dir), EngineConfig(num_kv_blocks=64, block_size=16, max_num_seqs=4))
    aengine = AsyncEngine(engine)

    async def main() -> int:
        return await aengine.read(lambda e: threading.get_ident())

    assert asyncio.run(main()) != threading.get_ident()
    aengine.thread.close()

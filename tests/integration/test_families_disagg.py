"""Every new family disaggregated in one process: a real prefill worker computes the prompt, a real decode
worker pulls its KV over NIXL (every KV group's blocks, or the latent rows) and decodes; the tokens equal
transformers' greedy ones; with an int8 latent (DeepSeek's cache quantized, one scale per block crossing
beside it) they equal the colocated engine's int8 tokens. ``test_families_serve.py`` runs two of them
(one of each new KV kind) through ``pdserve serve`` over HTTP as well."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from decode.worker import DecodeWorker
from engine.config import EngineConfig
from engine.sampling_params import SamplingParams
from messages.codec import pack, unpack
from messages.wire import GenerateRequest, PrefillResult, TokenBatch, WorkerStats
from prefill.worker import PrefillWorker
from tests.families import NEW_FAMILIES, hf_greedy, prompt, save
from tests.unit.decode_attempts import attempt_items

pytestmark = pytest.mark.slow
CONFIG = EngineConfig(dtype="float32", block_size=4, max_num_batched_tokens=16, num_kv_blocks=256,
                      num_threads=1)
NEW_TOKENS = 8


def _disaggregated(folder: Path, prompts: list[list[int]], config: EngineConfig = CONFIG
                   ) -> tuple[list[list[int]], WorkerStats]:
    prefill = PrefillWorker("prefill-f", str(folder), pack(config))
    decode = DecodeWorker("decode-f", str(folder), pack(config))

    async def run() -> tuple[list[list[int]], WorkerStats]:
        await decode.ready()
        assert await decode.connect(await prefill.ready()) == b""
        outputs = []
        for i, ids in enumerate(prompts):
            req = GenerateRequest(request_id=f"r{i}", prompt_token_ids=ids,
                                  sampling=SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0))
            answer: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
            answer.set_result(await prefill.prefill(pack(req)))
            assert isinstance(unpack(answer.result(), PrefillResult), PrefillResult)
            tokens: list[int] = []
            async for item in attempt_items(decode, req, [answer]):
                assert isinstance(item, TokenBatch), item
                tokens += item.token_ids
            outputs.append(tokens)
        stats = unpack(await decode.stats(), WorkerStats)
        await decode.aengine.stop()
        await prefill.aengine.stop()
        return outputs, stats

    return asyncio.run(run())


@pytest.mark.parametrize("family", NEW_FAMILIES)
def test_disaggregated_greedy_equals_transformers(family: str, tmp_path: Path) -> None:
    hf: Any = save(family, tmp_path)
    prompts = [prompt(n, seed=n) for n in (6, 23, 41)]
    outputs, stats = _disaggregated(tmp_path, prompts)
    assert outputs == [hf_greedy(hf, ids, NEW_TOKENS) for ids in prompts]
    assert stats.transfer.blocks > 0 and stats.transfer.failures == 0 and stats.kv.used_blocks == 0


def test_an_int8_latent_crosses_with_its_scales(tmp_path: Path) -> None:
    from dataclasses import replace

    from engine import LLM

    save("deepseek_v3", tmp_path)
    config = replace(CONFIG, kv_cache_dtype="int8")
    prompts = [prompt(n, seed=n) for n in (6, 23, 41)]
    outputs, stats = _disaggregated(tmp_path, prompts, config)
    llm = LLM(model=str(tmp_path), dtype="float32", block_size=4, max_num_batched_tokens=16,
              num_kv_blocks=256, num_threads=1, kv_cache_dtype="int8")
    greedy = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)
    # one prompt at a time, as the prefill worker took them: the same chunks write the same codes and scales
    assert outputs == [llm.generate([ids], greedy)[0].token_ids for ids in prompts]
    assert stats.transfer.blocks > 0 and stats.transfer.failures == 0 and stats.kv.used_blocks == 0

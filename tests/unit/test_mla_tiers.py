"""A latent (MLA) cache through the tiers every other cache has: preemption by swapping to host memory,
the host and disk offload tiers of evicted prefix blocks, and an int8 latent with its scales through
both. On the tiny DeepSeek-V3 model transformers saved (``tests/families.py``): the tokens equal an
unpressured run's, and a block's bytes are the latent's (3 layers x 4 tokens x 40 values)."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from engine.hashing import block_hashes
from tests.families import prompt, save

PARAMS = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
PROMPTS = [prompt(14 + 5 * i, seed=i) for i in range(4)]
SHARED = prompt(33, seed=7)  # 8 whole blocks of 4 tokens + 1
OTHERS = [prompt(30, seed=20 + i) for i in range(4)]
LAYERS, TOKENS, LATENT = 3, 4, 32 + 8  # kv_lora_rank + qk_rope_head_dim
TIGHT = 22  # blocks: the 4 requests need ~36, so some are preempted


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("deepseek_v3")
    save("deepseek_v3", folder)
    return folder


def _llm(model: Path, **kw: object) -> LLM:
    return LLM(str(model), dtype="float32", block_size=TOKENS, max_num_batched_tokens=32, num_threads=1,
               check_integrity=True, **kw)


def _tokens(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompts, PARAMS)]


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_swap_preemption_keeps_the_latent(model: Path, kv_cache_dtype: str) -> None:
    ample = _tokens(_llm(model, num_kv_blocks=200, kv_cache_dtype=kv_cache_dtype), PROMPTS)
    llm = _llm(model, num_kv_blocks=TIGHT, preemption_mode="swap", kv_cache_dtype=kv_cache_dtype)
    assert _tokens(llm, PROMPTS) == ample
    stats = llm.engine.stats()
    assert stats.num_swap_outs > 0 and stats.num_swap_ins == stats.num_swap_outs
    assert stats.swap_used_bytes == 0 and llm.engine.kv.pool.num_used_blocks == 0


def _evict_shared(llm: LLM) -> list[int]:
    """The shared prompt, then enough others that its blocks leave the device cache."""
    first = _tokens(llm, [SHARED])[0]
    for other in OTHERS:
        _tokens(llm, [other])
    kv = llm.engine.kv
    assert all(kv.pool.lookup(h) is None for h in block_hashes(SHARED, kv.block_size, kv.hash_seed))
    return first


@pytest.mark.parametrize(("kv_cache_dtype", "block_bytes"), [
    ("auto", LAYERS * TOKENS * LATENT * 4),  # float32 latents
    ("int8", LAYERS * (TOKENS * LATENT + 4)),  # int8 codes and one float32 scale per block and layer
])
def test_offload_tiers_restore_latent_blocks(model: Path, tmp_path: Path, kv_cache_dtype: str,
                                             block_bytes: int) -> None:
    """The host tier, then the disk tier across a restart: both give the evicted prompt back whole."""
    llm = _llm(model, num_kv_blocks=20, kv_offload_bytes=1 << 20, kv_cache_dtype=kv_cache_dtype)
    first = _evict_shared(llm)
    stats = llm.engine.stats()
    assert stats.kv_offload_host_blocks > 0
    assert stats.kv_offload_host_bytes == stats.kv_offload_host_blocks * block_bytes
    again = llm.generate([SHARED], PARAMS)[0]
    assert again.metrics.cached_prompt_tokens == 32 and again.token_ids == first
    assert llm.engine.stats().kv_offload_host_hits - stats.kv_offload_host_hits == 8

    on_disk = _llm(model, num_kv_blocks=20, kv_offload_dir=str(tmp_path), kv_cache_dtype=kv_cache_dtype)
    assert _evict_shared(on_disk) == first
    disk = on_disk.engine.stats()
    assert disk.kv_offload_disk_blocks >= 8
    assert disk.kv_offload_disk_bytes == disk.kv_offload_disk_blocks * block_bytes
    del on_disk

    restarted = _llm(model, num_kv_blocks=20, kv_offload_dir=str(tmp_path), kv_cache_dtype=kv_cache_dtype)
    assert restarted.engine.stats().kv_offload_disk_blocks >= 8
    again = restarted.generate([SHARED], PARAMS)[0]
    assert again.metrics.cached_prompt_tokens == 32 and again.token_ids == first
    assert restarted.engine.stats().kv_offload_disk_hits == 8

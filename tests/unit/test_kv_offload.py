"""The KV offload tiers: evicted prefix blocks restored from host memory and from disk (after a restart)."""

from __future__ import annotations

from pathlib import Path

from engine import LLM, SamplingParams
from engine.hashing import block_hashes

PARAMS = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
SHARED = [(5 * j) % 250 + 1 for j in range(33)]  # 8 full blocks of 4 tokens + 1
OTHERS = [[(11 * i + 3 * j) % 250 + 1 for j in range(30)] for i in range(1, 5)]


def engine(model: Path, **kw: object) -> LLM:
    return LLM(str(model), block_size=4, num_kv_blocks=20, check_integrity=True, **kw)


def evict_shared(llm: LLM) -> list[int]:
    """Run the shared prompt, then enough others that its blocks leave the device cache."""
    first = llm.generate([SHARED], PARAMS)[0].token_ids
    for other in OTHERS:
        llm.generate([other], PARAMS)
    kv = llm.engine.kv
    hashes = block_hashes(SHARED, kv.block_size, kv.hash_seed)
    assert all(kv.pool.lookup(h) is None for h in hashes)  # gone from the device cache
    return first


def test_host_tier_restores_evicted_prefix_blocks(tiny_model_dir: Path) -> None:
    without = engine(tiny_model_dir)
    evict_shared(without)
    assert without.generate([SHARED], PARAMS)[0].metrics.cached_prompt_tokens == 0

    llm = engine(tiny_model_dir, kv_offload_bytes=1 << 20)
    first = evict_shared(llm)
    stats = llm.engine.stats()
    assert stats.kv_offload_stores > 0 and stats.kv_offload_host_blocks > 0
    # a block: 2 layers x 2 x 4 tokens x 2 heads x 16 dims x 4 bytes
    assert stats.kv_offload_host_bytes == stats.kv_offload_host_blocks * 2048
    again = llm.generate([SHARED], PARAMS)[0]
    assert again.metrics.cached_prompt_tokens == 32 and again.token_ids == first
    after = llm.engine.stats()
    assert after.kv_offload_host_hits - stats.kv_offload_host_hits == 8
    assert after.kv_offload_disk_hits == 0


def test_disk_tier_serves_hits_after_a_restart(tiny_model_dir: Path, tmp_path: Path) -> None:
    first_engine = engine(tiny_model_dir, kv_offload_dir=str(tmp_path))
    first = evict_shared(first_engine)
    disk = first_engine.engine.stats()
    assert disk.kv_offload_disk_blocks >= 8
    assert disk.kv_offload_disk_bytes == disk.kv_offload_disk_blocks * 2048
    assert len(list(tmp_path.glob("*.kv"))) == disk.kv_offload_disk_blocks
    assert (tmp_path / "index.json").is_file()
    del first_engine

    restarted = engine(tiny_model_dir, kv_offload_dir=str(tmp_path))
    assert restarted.engine.stats().kv_offload_disk_blocks >= 8
    again = restarted.generate([SHARED], PARAMS)[0]
    assert again.metrics.cached_prompt_tokens == 32 and again.token_ids == first
    assert restarted.engine.stats().kv_offload_disk_hits == 8

    # another KV layout (block size) never reads these files: they are dropped on open
    other = LLM(str(tiny_model_dir), block_size=8, num_kv_blocks=20, kv_offload_dir=str(tmp_path))
    assert other.engine.stats().kv_offload_disk_blocks == 0
    assert other.generate([SHARED], PARAMS)[0].metrics.cached_prompt_tokens == 0

"""Capacity per KV dtype and tier: ``pdserve plan``'s table equals what engines allocate for the same
budget, the host tier holds exactly the blocks the plan says, and ``/metrics`` renders the engine's tiers."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from cli.main import main
from cli.plan import make_plan, read_model_config
from engine import LLM
from engine.kv_sizing import KV_CACHE_DTYPES, KvTier, kv_dtype_name
from messages.wire import KvStats, KvTierStats, RequestStats, WorkerStats
from router.metrics import worker_metrics
from tests.unit.test_kv_offload import PARAMS, SHARED, evict_shared

# The tiny model (2 layers, 2 KV heads x 16): 512 bytes per token in float32, 128 in fp8/int8, plus
# 2 x 2 layers x 2 heads x 4 bytes of scales per quantized block.
TINY_ROWS = {  # dtype: (block bytes at 16 tokens, blocks in 1 MiB, host blocks in 256 KiB, disk in 512 KiB)
    "float32": (8192, 128, 32, 64),
    "fp8": (2080, 504, 126, 252),
    "fp8_e5m2": (2080, 504, 126, 252),
    "int8": (2080, 504, 126, 252),
    "int4": (1088, 963, 240, 481),  # 16 x 2 x 2 x 2 x 8 code bytes + 2 x 2 x 2 x 1 group x 8 range bytes
}


def plan_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    assert main(["plan", *argv, "--json"]) == 0
    return dict(json.loads(capsys.readouterr().out))


def test_plan_rows_equal_what_engines_allocate(tiny_model_dir: Path, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    plan = plan_json(capsys, str(tiny_model_dir), "--dtype", "float32", "--kv-cache-memory", "1M",
                     "--kv-offload-bytes", "256K", "--kv-offload-disk-bytes", "512K",
                     "--max-model-len", "256")
    rows = {r["kv_cache_dtype"]: r for r in plan["by_kv_dtype"]}
    assert list(rows) == list(TINY_ROWS)
    assert [r["selected"] for r in rows.values()] == [True, False, False, False, False]  # auto = --dtype
    for name, (block, blocks, host, disk) in TINY_ROWS.items():
        row = rows[name]
        assert (row["kv_block_bytes"], row["num_kv_blocks"], row["host_blocks"], row["disk_blocks"]) == (
            block, blocks, host, disk), name
        assert row["kv_tokens"] == 16 * blocks and row["host_tokens"] == 16 * host
        assert row["disk_tokens"] == 16 * disk and row["concurrent_sequences"] == blocks // 16
        assert row["block_bytes_per_token"] == block / 16
        assert row["kv_bytes_per_token"] == {"float32": 512, "int4": 64}.get(name, 128)

        llm = LLM(str(tiny_model_dir), dtype="float32", kv_cache_dtype="auto" if name == "float32" else name,
                  kv_cache_memory=1 << 20, kv_offload_bytes=256 << 10, kv_offload_dir=str(tmp_path / name),
                  kv_offload_disk_bytes=512 << 10)
        e = llm.engine
        assert e.runner.kv_cache.shape[1] == e.kv.num_blocks == blocks, name
        assert e.runner.kv_cache_bytes == blocks * block, name  # codes plus scales, as allocated
        assert e.offload is not None and e.offload.block_bytes == block
        assert (e.offload.host_capacity_blocks, e.offload.disk_capacity_blocks) == (host, disk)
        assert e.stats().kv_tiers == (KvTier("device", blocks, 0, block), KvTier("host", host, 0, block),
                                      KvTier("disk", disk, 0, block))
    # the main plan still describes --kv-cache-dtype and agrees with its row
    assert (plan["num_kv_blocks"], plan["kv_block_bytes"]) == (128, 8192)


def test_host_tier_fills_to_the_planned_block_count(tiny_model_dir: Path) -> None:
    model = read_model_config(tiny_model_dir)
    plan = make_plan(model, dtype="float32", kv_cache_dtype="fp8", block_size=4, kv_cache_memory=1 << 20,
                     kv_offload_bytes=3000)
    assert plan.by_kv_dtype is not None
    row = next(r for r in plan.by_kv_dtype if r.selected)
    assert (row.kv_cache_dtype, row.kv_block_bytes, row.host_blocks) == ("fp8", 544, 5)  # 3000 // 544
    llm = LLM(str(tiny_model_dir), block_size=4, num_kv_blocks=20, kv_cache_dtype="fp8",
              kv_offload_bytes=3000, check_integrity=True)
    evict_shared(llm)
    stats = llm.engine.stats()
    assert stats.kv_offload_stores > 5  # more blocks left the device than the host tier holds
    assert stats.kv_offload_host_blocks == row.host_blocks
    assert stats.kv_offload_host_bytes == 5 * 544


def scrape(stats: list[WorkerStats]) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    text = worker_metrics(stats).decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def worker_stats(llm: LLM, worker_id: str) -> WorkerStats:
    """What a worker's ``stats`` sends for this engine's KV (same fields as prefill/decode workers)."""
    e = llm.engine
    s = e.stats()
    kv = KvStats(num_blocks=s.num_kv_blocks, free_blocks=s.num_free_kv_blocks,
                 used_blocks=e.num_used_blocks(), block_size=e.kv.block_size,
                 dtype=kv_dtype_name(e.config.kv_torch_dtype),
                 tiers=[KvTierStats(**dataclasses.asdict(t)) for t in s.kv_tiers])
    return WorkerStats(worker_id=worker_id, role="decode",
                       requests=RequestStats(running=s.num_running, waiting=s.num_waiting), kv=kv)


def test_metrics_per_tier_and_dtype(tiny_model_dir: Path, tmp_path: Path) -> None:
    llm = LLM(str(tiny_model_dir), block_size=4, num_kv_blocks=20, kv_cache_dtype="fp8",
              kv_offload_bytes=1 << 20, kv_offload_dir=str(tmp_path), kv_offload_disk_bytes=64 << 10)
    evict_shared(llm)
    assert llm.generate([SHARED], PARAMS)[0].metrics.cached_prompt_tokens == 32  # 8 blocks from the host
    plain = LLM(str(tiny_model_dir), block_size=4, num_kv_blocks=12)
    got = scrape([worker_stats(llm, "q"), worker_stats(plain, "p")])
    stored = llm.engine.stats().kv_offload_host_blocks
    assert stored > 0

    def value(name: str, worker: str, tier: str, dtype: str) -> float:
        labels = {"worker": worker, "role": "decode", "tier": tier, "kv_cache_dtype": dtype}
        return got[(f"pdserve:{name}", frozenset(labels.items()))]

    expected = {  # tier: (capacity blocks, used blocks), fp8 blocks of 4 x 128 + 32 = 544 bytes
        "device": (20, 0), "host": ((1 << 20) // 544, stored), "disk": ((64 << 10) // 544, 0)}
    for tier, (blocks, used) in expected.items():
        assert value("kv_cache_capacity_blocks", "q", tier, "fp8") == blocks
        assert value("kv_cache_capacity_tokens", "q", tier, "fp8") == blocks * 4
        assert value("kv_cache_capacity_bytes", "q", tier, "fp8") == blocks * 544
        assert value("kv_cache_used_blocks", "q", tier, "fp8") == used
    assert value("kv_offload_hits_total", "q", "host", "fp8") == 8
    assert value("kv_offload_hits_total", "q", "disk", "fp8") == 0
    assert value("kv_cache_capacity_bytes", "p", "device", "float32") == 12 * 4 * 512
    # tiers that are not configured have no series; the device tier has no hits counter
    tiers = {dict(labels)["tier"] for (name, labels) in got if name.startswith("pdserve:kv_cache_capacity")
             and dict(labels)["worker"] == "p"}
    assert tiers == {"device"}
    assert not any(n == "pdserve:kv_offload_hits_total" and dict(ls)["tier"] == "device" for n, ls in got)
    assert {(n, ls) for n, ls in got if n == "pdserve:kv_cache_usage_perc"}  # existing names stay


def test_plan_table_and_errors(tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", str(tiny_model_dir), "--dtype", "float32", "--kv-cache-dtype", "int8",
                 "--kv-cache-memory", "1M", "--kv-offload-bytes", "256K", "--max-model-len", "256"]) == 0
    out = capsys.readouterr().out
    assert "KV dtype    bytes/token  block bytes  blocks  tokens  seqs@256  host blocks  host tokens\n" in out
    assert "  float32           512        8,192     128   2,048         8           32          512\n" in out
    assert "* int8              130        2,080     504   8,064        31          126        2,016\n" in out
    assert "disk blocks" not in out
    assert set(KV_CACHE_DTYPES) >= {"fp8", "fp8_e5m2", "int8"}
    for flag in ("--kv-offload-bytes", "--kv-offload-disk-bytes"):
        assert main(["plan", str(tiny_model_dir), flag, "lots"]) == 2
        assert f"argument {flag}: invalid size 'lots'" in capsys.readouterr().err
    no_tiers = make_plan(read_model_config(tiny_model_dir), dtype="float32", kv_cache_memory=1 << 20)
    assert no_tiers.by_kv_dtype is not None and no_tiers.by_kv_dtype[0].host_blocks is None
    assert dataclasses.asdict(no_tiers)["kv_offload_bytes"] is None

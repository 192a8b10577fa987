"""KV transfer between workers of different tensor-parallel sizes: GB/s and NIXL descriptors per pull.

``python -m bench.lab.tp_transfer [--pairs 1:1,2:1,1:2,2:2] [--blocks 128] [--repeats 5]`` starts prefill
and decode engines of the bench's Llama (``bench/lab/tensor_parallel.py``: 30 layers, 2 KV heads of 64,
fp32: 30,720 KV bytes a token) at each TP size of the pairs, with rank processes and one NIXL agent per
rank as a serving worker has them (``worker/tp_kv.py``), fills prefill rank 0's KV with seeded random
bytes, and per pair ``P:D`` times ``--repeats`` pulls of ``--blocks`` blocks (16 tokens each) into
decode, every decode rank reading its KV heads from the prefill ranks holding them (through its
staging buffer where the head ranges differ, ``transfer/staging.py``). Prints per pair: KV bytes placed,
bytes read through staging (all ranks), descriptors (all ranks), median seconds and GB/s of the KV
bytes, and a plain ``torch`` copy of the same bytes in this process for scale. The engines share
the machine's cores; on a CPU host UCX moves the bytes
with ``process_vm_readv`` (cma).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

from bench.lab.tensor_parallel import model_dir
from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.llm import start_engine
from engine.tp_ranks import RankProcesses
from transfer.nixl_sink import KvSink
from transfer.nixl_source import KvSource
from transfer.wire import AgentInfo, KvHandle
from worker.tp_kv import EXTENSION, GroupSink, open_sink, open_source

KV_MEMORY = 160 * 1024**2


def engine(size: int) -> tuple[LLMEngine, RankProcesses | None]:
    config = EngineConfig(dtype="float32", tensor_parallel_size=size, num_threads=1,
                          kv_cache_memory=KV_MEMORY, enable_prefix_caching=False, tp_timeout_s=120.0)
    return start_engine(str(model_dir()), config, extension=EXTENSION)


def measure(source: KvSource, info: AgentInfo, sink: KvSink | GroupSink, blocks: int,
            repeats: int) -> dict[str, Any]:
    sink.connect(info)
    ids = list(range(blocks))
    seconds, descriptors, nbytes, staged = [], 0, 0, 0
    for i in range(repeats + 1):  # the first pull warms the connections up
        handle = KvHandle(f"bench-{i}-{time.monotonic_ns()}", info.agent_name, ids, blocks * 16,
                          info.compat_hash, time.time() + 120)
        start = time.perf_counter()
        stats = sink.read_blocking(handle, ids, ids, 120.0)
        if i:
            seconds.append(time.perf_counter() - start)
        descriptors, nbytes, staged = stats.descriptors, stats.bytes, stats.staged_bytes
        source.poll()
    median = statistics.median(seconds)
    return {"bytes": nbytes, "staged_bytes": staged, "descriptors": descriptors, "median_s": round(median, 4),
            "gb_s": round(nbytes / median / 1e9, 3)}


def copy_gb_s(nbytes: int, repeats: int) -> float:
    a = torch.empty(nbytes // 4)
    b = torch.empty_like(a)
    b.copy_(a)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        b.copy_(a)
        times.append(time.perf_counter() - start)
    return round(nbytes / statistics.median(times) / 1e9, 3)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.lab.tp_transfer",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", default="1:1,2:1,1:2,2:2", help="prefill:decode TP sizes, comma-separated")
    parser.add_argument("--blocks", type=int, default=128, help="blocks per pull (16 tokens each)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    pairs = [tuple(int(x) for x in p.split(":")) for p in args.pairs.split(",")]
    engines: dict[tuple[str, int], tuple[LLMEngine, RankProcesses | None]] = {}
    sources: dict[int, tuple[KvSource, AgentInfo]] = {}
    sinks: dict[int, KvSink | GroupSink] = {}
    try:
        for p, d in pairs:
            if p not in sources:
                engines["prefill", p] = engine(p)
                torch.manual_seed(p)  # rank 0's shard random (the bytes do not change the speed)
                cache = engines["prefill", p][0].runner.kv_cache
                cache.copy_(torch.randn_like(cache))
                sources[p] = open_source(engines["prefill", p][0], f"bench-p{p}")
            if d not in sinks:
                engines["decode", d] = engine(d)
                sinks[d] = open_sink(engines["decode", d][0], f"bench-d{d}")
        for p, d in pairs:
            source, info = sources[p]
            row = {"prefill_tp": p, "decode_tp": d, "blocks": args.blocks,
                   **measure(source, info, sinks[d], args.blocks, args.repeats)}
            row["plain_copy_gb_s"] = copy_gb_s(row["bytes"], args.repeats)
            print(json.dumps(row), flush=True)
    finally:
        for source, _ in sources.values():
            source.close()
        for sink in sinks.values():
            sink.close()
        for _, ranks in engines.values():
            if ranks is not None:
                ranks.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

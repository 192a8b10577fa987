"""Disaggregated TTFT and the KV transfer's share of it, on a real 1 prefill + 1 decode Ray cluster.

``python -m bench.lab.disagg [--prompt-len 2048] [--repeats 3] [--json OUT]``

For each repeat a fresh random prompt (no prefix hits) goes through the
disaggregated path with ``max_tokens=1``; TTFT is measured at the client and
the transfer time, blocks and bytes are read from the decode worker's
counters. The same prompts then run colocated on the decode worker.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import time
import uuid
from typing import Any

import ray

from cluster.workers import start_workers
from engine.config import EngineConfig
from engine.sampling_params import SamplingParams
from messages.wire import GenerateRequest, WorkerStats
from router.client import PDClient


async def ttft(client: PDClient, tokens: list[int]) -> float:
    req = GenerateRequest(request_id=uuid.uuid4().hex, prompt_token_ids=tokens,
                          sampling=SamplingParams(max_tokens=1, temperature=0.0))
    start = time.perf_counter()
    async for _ in client.generate(req):
        break
    return time.perf_counter() - start


def decode_stats(stats: list[WorkerStats]) -> WorkerStats:
    return next(s for s in stats if s.role == "decode")


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    config = EngineConfig(dtype=args.dtype, max_num_batched_tokens=2048, kv_cache_memory=512 * 2**20)
    group = start_workers(args.model, config, num_prefill=1, num_decode=1)
    disagg = PDClient(group.prefill, group.decode)
    colocated = PDClient([], group.decode)
    await disagg.start()
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(args.prompt_len)] for _ in range(args.repeats + 1)]
    await ttft(disagg, prompts[-1])  # warm-up: first NIXL connection and first forward
    rows = []
    for tokens in prompts[:-1]:
        before = decode_stats(await disagg.stats())
        t = await ttft(disagg, tokens)
        after = decode_stats(await disagg.stats())
        seconds = after.transfer.seconds - before.transfer.seconds
        nbytes = after.transfer.bytes - before.transfer.bytes
        rows.append({"ttft_s": t, "transfer_s": seconds, "bytes": nbytes,
                     "blocks": after.transfer.blocks - before.transfer.blocks,
                     "gb_per_s": nbytes / seconds / 1e9, "share_of_ttft": seconds / t})
    local = [await ttft(colocated, [t + 1 for t in p]) for p in prompts[:-1]]
    for actor in group.all():
        ray.kill(actor)
    return {
        "prompt_len": args.prompt_len, "dtype": args.dtype, "runs": rows,
        "median_ttft_disagg_s": statistics.median(r["ttft_s"] for r in rows),
        "median_ttft_colocated_s": statistics.median(local),
        "median_transfer_s": statistics.median(r["transfer_s"] for r in rows),
        "median_share_of_ttft": statistics.median(r["share_of_ttft"] for r in rows),
        "median_gb_per_s": statistics.median(r["gb_per_s"] for r in rows),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model folder or .gguf (default: built-in SmolLM2)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--prompt-len", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args()
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    result = asyncio.run(main_async(args))
    ray.shutdown()
    print(f"| prompt tokens | dtype | TTFT disagg (s) | TTFT colocated (s) | transfer (s) "
          f"| share of TTFT | GB/s | bytes |\n|---|---|---|---|---|---|---|---|\n"
          f"| {args.prompt_len} | {args.dtype} | {result['median_ttft_disagg_s']:.3f} "
          f"| {result['median_ttft_colocated_s']:.3f} | {result['median_transfer_s']:.4f} "
          f"| {100 * float(result['median_share_of_ttft']):.1f}% | {result['median_gb_per_s']:.2f} "
          f"| {result['runs'][0]['bytes']} |")
    print(f"machine: {os.cpu_count()} cores")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()

"""Prefix-aware routing against round-robin on a shared-prefix workload, 2 prefill + 2 decode workers.

``python -m bench.lab.routing [--system-prompts 8] [--questions 8] [--prefix-len 1024] [--concurrency 4]``

Each of N system prompts (``--prefix-len`` tokens, distinct) is followed by M
short questions; the N x M requests are sent in a seeded random order with a
fixed concurrency, once per policy, each policy on freshly started workers so
no cache carries over. Each worker's KV (``--kv-cache-memory``) holds fewer
prefixes than the workload has, as in production where the working set
outgrows one worker's cache. Reported: prefix-cache hit rate (prompt tokens served
from a cache, on the decode or prefill worker, / prompt tokens), mean and p90
TTFT, and wall time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
import uuid
from typing import Any

import ray

from cluster.workers import start_workers
from engine.config import EngineConfig
from engine.loader import load_model_source, resolve_model
from engine.sampling_params import SamplingParams
from messages.wire import GenerateRequest
from router.client import PDClient
from router.config import ClientConfig
from router.policy import POLICIES


def workload(args: argparse.Namespace) -> list[tuple[int, list[int]]]:
    """(system prompt number, prompt tokens) per request, in the order they are sent."""
    tok = load_model_source(resolve_model(args.model)).load_tokenizer()
    rng = random.Random(0)
    words = [
        "harbour",
        "tide",
        "storm",
        "lantern",
        "ledger",
        "anchor",
        "rope",
        "sail",
        "keel",
        "compass",
        "chart",
        "beacon",
        "reef",
        "gull",
        "current",
        "mooring",
        "ballast",
        "rudder",
        "mast",
        "hull",
        "pier",
        "quay",
        "dune",
        "cliff",
    ]
    prompts = []
    for s in range(args.system_prompts):
        text = f"System {s}: " + " ".join(rng.choice(words) for _ in range(args.prefix_len * 2))
        prefix = tok.encode(text)[: args.prefix_len]
        for q in range(args.questions):
            question = tok.encode(f" Question {q}: what does entry {rng.randrange(999)} say?")
            prompts.append((s, prefix + question))
    rng.shuffle(prompts)
    return prompts


async def run_policy(args: argparse.Namespace, policy: str,
                     prompts: list[tuple[int, list[int]]]) -> dict[str, Any]:
    config = EngineConfig(dtype="float32", max_num_batched_tokens=1024, kv_cache_memory=args.kv_cache_memory)
    group = start_workers(args.model, config, num_prefill=2, num_decode=2)
    client = PDClient(group.prefill, group.decode,
                      ClientConfig(routing=policy, disagg_min_tokens=args.disagg_min_tokens))
    await client.start()
    sem = asyncio.Semaphore(args.concurrency)
    ttfts: list[float] = []
    cached = total = 0
    t0 = time.perf_counter()
    log: list[dict[str, Any]] = []

    async def one(system: int, tokens: list[int]) -> None:
        nonlocal cached, total
        async with sem:
            req = GenerateRequest(
                request_id=uuid.uuid4().hex,
                prompt_token_ids=tokens,
                sampling=SamplingParams(max_tokens=4, temperature=0.0),
            )
            start = time.perf_counter()
            first = True
            async for batch in client.generate(req):
                if first:
                    ttfts.append(time.perf_counter() - start)
                    cached += batch.cached_tokens
                    total += batch.prompt_tokens
                    first = False
                    log.append({"system": system, "sent_s": round(start - t0, 3),
                                "ttft_s": round(ttfts[-1], 3), "decode": batch.worker_id,
                                "prompt_tokens": batch.prompt_tokens, "cached_tokens": batch.cached_tokens})

    await asyncio.gather(*[one(s, p) for s, p in prompts])
    wall = time.perf_counter() - t0
    decisions = {"/".join(k): v for k, v in client.routing_decisions().items()}
    await client.close()
    for actor in group.all():
        ray.kill(actor)
    ttfts.sort()
    return {
        "policy": policy,
        "requests": len(prompts),
        "hit_rate": cached / total,
        "ttft_mean_s": statistics.mean(ttfts),
        "ttft_p90_s": ttfts[int(0.9 * (len(ttfts) - 1))],
        "wall_s": wall,
        "decisions": decisions,
        "requests_log": log,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--system-prompts", type=int, default=8)
    parser.add_argument("--questions", type=int, default=8)
    parser.add_argument("--prefix-len", type=int, default=1024)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--disagg-min-tokens", type=int, default=128,
                        help="prompts whose part the decode worker lacks is shorter prefill there")
    parser.add_argument("--kv-cache-memory", type=int, default=256 * 2**20,
                        help="KV bytes per worker; the default holds about four of the eight prefixes, "
                        "so a policy that spreads every prefix over every worker evicts")
    parser.add_argument("--policies", default="prefix,round-robin",
                        help="comma-separated routing policies to run, in order")
    parser.add_argument("--json", default=None,
                        help="write the results, with one record per request (system prompt, decode worker, "
                        "cached tokens, TTFT), to this file")
    args = parser.parse_args()
    prompts = workload(args)
    ray.init(
        address="local",
        num_cpus=8,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}},
    )
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    unknown = [p for p in policies if p not in POLICIES]
    if unknown or not policies:
        parser.error(f"--policies takes names among {', '.join(POLICIES)}, got {args.policies!r}")
    results = [asyncio.run(run_policy(args, p, prompts)) for p in policies]
    ray.shutdown()
    print("| policy | requests | prefix hit rate | TTFT mean (s) | TTFT p90 (s) | wall (s) |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in results:
        print(
            f"| {r['policy']} | {r['requests']} | {100 * r['hit_rate']:.1f}% | {r['ttft_mean_s']:.2f} "
            f"| {r['ttft_p90_s']:.2f} | {r['wall_s']:.1f} |"
        )
    by_name = {r["policy"]: r for r in results}
    if "prefix" in by_name and "round-robin" in by_name:
        ratio = by_name["round-robin"]["ttft_mean_s"] / by_name["prefix"]["ttft_mean_s"]
        print(f"mean TTFT, round-robin / prefix: {ratio:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()

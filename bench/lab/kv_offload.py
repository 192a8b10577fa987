"""Prefix reuse beyond the device KV cache: with and without the host offload tier.

``--num-prefixes`` distinct shared prefixes of ``--prefix-len`` random token ids are
each used by ``--rounds`` requests (prefix + a short distinct suffix), visited
round-robin, one request at a time, greedy, ``--output-len`` tokens. The device KV
cache (``--num-kv-blocks``) holds fewer blocks than all the prefixes together, so
without a tier every revisit recomputes its prefix; with ``--kv-offload-bytes``
large enough for them, revisits restore the evicted blocks from host memory.
Reports the prefix-cache hit rate (prompt tokens served from cache / prompt tokens,
over the revisiting rounds) and the mean TTFT of those requests.

    python -m bench.lab.kv_offload [--model PATH] [--num-prefixes 6] [--prefix-len 256]
        [--num-kv-blocks 48] [--rounds 3] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

from engine import LLM, SamplingParams


def run(args: argparse.Namespace, offload_bytes: int, prompts: list[list[list[int]]]) -> dict[str, Any]:
    llm = LLM(args.model, num_kv_blocks=args.num_kv_blocks, kv_offload_bytes=offload_bytes)
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))  # warm-up
    ttfts: list[float] = []
    cached = total = 0
    start = time.perf_counter()
    for r, round_prompts in enumerate(prompts):
        for prompt in round_prompts:
            out = llm.generate([prompt], params)[0]
            if r == 0:
                continue
            assert out.metrics.first_token_time is not None
            ttfts.append(out.metrics.first_token_time - out.metrics.arrival_time)
            cached += out.metrics.cached_prompt_tokens
            total += len(prompt)
    stats = llm.engine.stats()
    return {"kv_offload_bytes": offload_bytes, "hit_rate": cached / total,
            "mean_ttft_s": statistics.mean(ttfts),
            "elapsed_s": time.perf_counter() - start, "host_hits": stats.kv_offload_host_hits,
            "stores": stats.kv_offload_stores}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--num-prefixes", type=int, default=6)
    parser.add_argument("--prefix-len", type=int, default=256)
    parser.add_argument("--num-kv-blocks", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--output-len", type=int, default=4)
    parser.add_argument("--offload-bytes", type=int, default=256 * 2**20)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    gen = torch.Generator().manual_seed(0)
    prefixes = torch.randint(100, 40000, (args.num_prefixes, args.prefix_len), generator=gen).tolist()
    prompts = [[p + torch.randint(100, 40000, (8,), generator=gen).tolist() for p in prefixes]
               for _ in range(args.rounds)]
    rows = [run(args, 0, prompts), run(args, args.offload_bytes, prompts)]
    for row in rows:
        print(f"kv_offload_bytes={row['kv_offload_bytes']}: prefix hit rate {row['hit_rate']:.1%}, "
              f"mean TTFT {row['mean_ttft_s'] * 1000:.0f} ms, host-tier block hits {row['host_hits']}, "
              f"blocks stored {row['stores']}, total {row['elapsed_s']:.1f} s", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

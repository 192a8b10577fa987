"""Recompute against swap preemption under KV memory pressure: throughput and TTFT side by side.

Seeded random prompts (exactly ``--input-len`` token ids each, no shared prefixes),
greedy, exactly ``--output-len`` new tokens, all submitted at once to an engine whose
KV cache (``--num-kv-blocks``) holds only part of the batch, so requests are
preempted. Both modes run the same batch; the run also checks that their outputs
are identical token for token.

    python -m bench.lab.preemption [--model PATH] [--num-prompts 12] [--input-len 128]
        [--output-len 64] [--num-kv-blocks 48] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

from engine import LLM, SamplingParams


def run_mode(args: argparse.Namespace, mode: str, prompts: list[list[int]]) -> dict[str, Any]:
    llm = LLM(args.model, preemption_mode=mode, num_kv_blocks=args.num_kv_blocks,
              max_num_seqs=args.num_prompts, max_num_batched_tokens=512)
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    llm.generate([prompts[0][:8]], SamplingParams(max_tokens=2))  # warm-up
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    ttfts = [o.metrics.first_token_time - o.metrics.arrival_time for o in outs
             if o.metrics.first_token_time is not None]
    stats = llm.engine.stats()
    return {"mode": mode, "elapsed_s": elapsed, "output_tok_s": args.num_prompts * args.output_len / elapsed,
            "mean_ttft_s": statistics.mean(ttfts), "p90_ttft_s": sorted(ttfts)[int(0.9 * (len(ttfts) - 1))],
            "preemptions": stats.num_preemptions, "swap_outs": stats.num_swap_outs,
            "tokens": [o.token_ids for o in outs]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--num-prompts", type=int, default=12)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--num-kv-blocks", type=int, default=48)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(100, 40000, (args.num_prompts, args.input_len), generator=gen).tolist()
    rows = [run_mode(args, mode, prompts) for mode in ("recompute", "swap")]
    same = sum(a == b for a, b in zip(rows[0]["tokens"], rows[1]["tokens"], strict=True))
    for row in rows:
        row.pop("tokens")
        print(f"{row['mode']:>9}: {row['elapsed_s']:.1f} s, {row['output_tok_s']:.1f} output tok/s, "
              f"mean TTFT {row['mean_ttft_s']:.2f} s, p90 TTFT {row['p90_ttft_s']:.2f} s, "
              f"preemptions {row['preemptions']}, swap-outs {row['swap_outs']}", flush=True)
    print(f"identical outputs: {same}/{args.num_prompts}")
    if any(row["preemptions"] == 0 for row in rows):
        print("warning: a mode preempted nothing; lower --num-kv-blocks to compare the modes")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "identical": same}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

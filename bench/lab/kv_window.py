"""An endless session with bounded KV: attention sinks + sliding window over a long generation.

One greedy request generates ``--tokens`` tokens (EOS ignored) on an engine with
``--kv-sinks`` / ``--kv-window`` and a small KV pool (``--num-kv-blocks``, far fewer
tokens than the generation). Every ``--every`` tokens it prints the KV blocks the
request holds, the pool's used blocks and the process RSS, so a flat line shows the
memory is bounded; at the end a sample of the text.

    python -m bench.lab.kv_window [--model PATH] [--tokens 20000] [--kv-sinks 4]
        [--kv-window 512] [--num-kv-blocks 64] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from typing import Any

from engine import LLM, SamplingParams


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * resource.getpagesize() / 2**20


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--tokens", type=int, default=20000)
    parser.add_argument("--kv-sinks", type=int, default=4)
    parser.add_argument("--kv-window", type=int, default=512)
    parser.add_argument("--num-kv-blocks", type=int, default=64)
    parser.add_argument("--every", type=int, default=1000)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    llm = LLM(args.model, num_kv_blocks=args.num_kv_blocks, kv_sinks=args.kv_sinks, kv_window=args.kv_window)
    engine = llm.engine
    story = "Tell me a very long story about a lighthouse keeper."
    try:
        prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": story}])
    except ValueError:  # a model without a chat template
        prompt = engine.tokenizer.encode(story) or [1]
    request = engine.add_request(prompt, SamplingParams(max_tokens=args.tokens, temperature=0.0,
                                                        ignore_eos=True, repetition_penalty=1.3))
    rows: list[dict[str, Any]] = []
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
        n = len(request.output_token_ids)
        if n % args.every == 0 or not engine.has_unfinished():
            row = {"tokens": n, "request_blocks": len(engine.kv.blocks_of(request.request_id)),
                   "pool_used_blocks": engine.kv.num_blocks - engine.kv.num_free_blocks,
                   "rss_mib": round(rss_mib(), 1), "elapsed_s": round(time.perf_counter() - start, 1)}
            if not rows or rows[-1]["tokens"] != n:
                rows.append(row)
                print(json.dumps(row), flush=True)
    engine.kv.check_integrity()
    print(f"done: {len(request.output_token_ids)} tokens, {engine.kv.num_free_blocks}/{engine.kv.num_blocks} "
          "blocks free, block pool integrity checked")
    text = engine.tokenizer.decode(request.output_token_ids)
    print("--- first 400 characters ---\n" + text[:400])
    print("--- last 400 characters ---\n" + text[-400:])
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "head": text[:400], "tail": text[-400:]}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

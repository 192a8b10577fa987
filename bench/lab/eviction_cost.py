"""What scoring blocks for ``--kv-eviction h2o`` costs a decode step, against eviction off.

For each ``--batches`` size B: B requests of ``--context`` random prompt tokens are prefilled, then
``--steps`` decode steps are timed (``LLMEngine.step``, median) under four engines over the same
weights, in turn, ``--rounds`` times:

- ``native``: the default (the native CPU attention kernel, the one-call decoder), eviction off;
- ``layered``: ``--no-native-decoder``, the native kernels layer by layer;
- ``h2o``: ``--kv-eviction h2o`` with a budget above the context, so nothing is evicted: the one-call
  decoder plus its scoring pass (``kernels/cpu_attention_mass.c``); the difference from ``native`` is
  the scoring alone;
- ``h2o-torch``: the same on the torch kernel (``attention_backend="torch"``), its explicit softmax.

    python -m bench.lab.eviction_cost [--batches 1,16] [--context 512] [--steps 16] [--rounds 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from engine import LLM, SamplingParams

CONFIGS: dict[str, dict[str, object]] = {
    "native": {},
    "layered": {"native_decoder": False},
    "h2o": {"kv_eviction": "h2o"},
    "h2o-torch": {"kv_eviction": "h2o", "attention_backend": "torch"},
}


def decode_ms(llm: LLM, batch: int, context: int, steps: int) -> float:
    """Median ms of ``steps`` decode steps of ``batch`` sequences at ``context`` tokens."""
    engine = llm.engine
    gen = torch.Generator().manual_seed(batch)
    params = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
    for _ in range(batch):
        engine.add_request(torch.randint(100, 20000, (context,), generator=gen).tolist(), params)
    while any(r.num_computed_tokens < r.num_tokens - 1 for r in engine.scheduler.running) or \
            engine.scheduler.waiting:
        engine.step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    while engine.has_unfinished():
        engine.step()
    return statistics.median(times) * 1000


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    blocks = max(batches) * (args.context // 16 + 4) + 64
    llms = {name: LLM(args.model, num_threads=args.threads, num_kv_blocks=blocks, max_num_seqs=max(batches),
                      enable_prefix_caching=False,
                      **({**extra, "kv_budget": args.context * 4} if "kv_eviction" in extra else extra))
            for name, extra in CONFIGS.items()}
    results: dict[tuple[str, int], list[float]] = {}
    for _ in range(args.rounds):
        for batch in batches:
            for name, llm in llms.items():
                results.setdefault((name, batch), []).append(decode_ms(llm, batch, args.context, args.steps))
    print(f"load average {os.getloadavg()[0]:.2f}; context {args.context}, median of {args.steps} steps")
    print("| batch | " + " | ".join(f"{n} ms/step" for n in CONFIGS) + " | h2o / native | h2o-torch / h2o |")
    print("|---:|" + "---:|" * (len(CONFIGS) + 2))
    for batch in batches:
        cells = [", ".join(f"{t:.1f}" for t in results[(n, batch)]) for n in CONFIGS]
        best = {n: min(results[(n, batch)]) for n in CONFIGS}
        print(f"| {batch} | " + " | ".join(cells) +
              f" | {best['h2o'] / best['native']:.2f} | {best['h2o-torch'] / best['h2o']:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

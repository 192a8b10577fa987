"""The GEMM floor of the offline workload: its linear layers alone, at the best batch shapes.

Any engine running ``bench.offline``'s workload (``--num-prompts`` prompts of
``--input-len`` tokens, ``--output-len`` new tokens each, greedy) with the same
weights in the same dtype must run these matrix products: every layer's QKV,
output, gate/up and down projections for every prompt and generated token, and
the LM head for every generated token. This times exactly those products with
``torch.nn.functional.linear`` on random weights of the model's shapes:

- prefill: all prompt tokens in chunks of ``--chunk`` rows (as large as helps);
- decode: ``--output-len`` steps of one row per prompt (what a batch of
  ``--num-prompts`` sequences allows), LM head included.

Attention, norms, rope, sampling and scheduling are left out, so the sum is a
lower bound on the workload's time on this machine; ``bench.offline``'s
transformers time divided by it is the largest speed-up any engine could show.

    python -m bench.gemm_floor [--model PATH] [--num-prompts 64] [--input-len 256]
        [--output-len 128] [--chunk 512,1024,2048,4096] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

from engine.config import ModelConfig
from engine.loader import load_model_source, resolve_model


def layer_shapes(cfg: ModelConfig) -> list[tuple[int, int]]:
    """``(in, out)`` of one decoder layer's linear layers."""
    h, kv = cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim
    q = cfg.num_heads * cfg.head_dim
    return [(h, q + 2 * kv), (q, h), (h, 2 * cfg.intermediate_size), (cfg.intermediate_size, h)]


def time_rows(cfg: ModelConfig, weights: list[torch.Tensor], head: torch.Tensor, rows: int,
              head_rows: int, repeats: int) -> float:
    """Best-of-``repeats`` seconds for one pass of ``rows`` rows through every layer's GEMMs."""
    inputs = [torch.randn(rows, w.shape[1]) for w in weights]
    head_in = torch.randn(head_rows, cfg.hidden_size) if head_rows else None
    best = float("inf")
    for _ in range(repeats + 1):  # the first pass warms up
        start = time.perf_counter()
        for _ in range(cfg.num_layers):
            for x, w in zip(inputs, weights, strict=True):
                F.linear(x, w)
        if head_in is not None:
            F.linear(head_in, head)
        best = min(best, time.perf_counter() - start)
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--chunk", default="512,1024,2048,4096")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    cfg = load_model_source(resolve_model(args.model)).config
    weights = [torch.randn(n, k) * 0.02 for k, n in layer_shapes(cfg)]
    head = torch.randn(cfg.vocab_size, cfg.hidden_size) * 0.02
    prompt_tokens = args.num_prompts * args.input_len
    flops_per_row = 2 * cfg.num_layers * sum(k * n for k, n in layer_shapes(cfg))
    prefill = {}
    for chunk in (int(c) for c in args.chunk.split(",")):
        steps = -(-prompt_tokens // chunk)
        seconds = time_rows(cfg, weights, head, chunk, 0, args.repeats) * steps
        prefill[chunk] = seconds
        print(f"prefill, chunks of {chunk}: {seconds:.1f} s for {prompt_tokens} tokens "
              f"({flops_per_row * steps * chunk / seconds / 1e9:.0f} GFLOP/s)", flush=True)
    decode = time_rows(cfg, weights, head, args.num_prompts, args.num_prompts, args.repeats) * args.output_len
    print(f"decode, {args.output_len} steps of {args.num_prompts} rows (LM head included): {decode:.1f} s")
    floor = min(prefill.values()) + decode
    print(f"GEMM floor: {floor:.1f} s; the fastest possible output tokens/s: "
          f"{args.num_prompts * args.output_len / floor:.1f} (torch threads: {torch.get_num_threads()})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"prefill_s": prefill, "decode_s": decode, "floor_s": floor,
                       "torch_threads": torch.get_num_threads()}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

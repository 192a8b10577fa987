"""Quantized KV cache quality: greedy agreement and perplexity against full-precision KV.

Greedy agreement: 16 fixed chat prompts, greedy, ``--output-len`` tokens each (EOS
ignored), once per ``--kv-cache-dtype``; a prompt agrees when its first
``--output-len`` tokens equal those of the ``auto`` (model dtype) run exactly.

Perplexity: a fixed English text, teacher-forced through the engine's model in
chunks of ``--ppl-chunk`` tokens, so every chunk attends to the earlier chunks as
stored in the (quantized) paged cache, as decode does.

    python -m bench.kv_quant [--model PATH] [--dtypes auto,fp8,fp8_e5m2,int8]
        [--output-len 32] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import math
import time
from typing import Any

import torch

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.engine import LLMEngine
from kernels import AttentionMetadata

PROMPTS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Explain gravity in one sentence.",
    "Write a haiku about the sea.",
    "What is 12 times 7?",
    "Give me a tip for staying focused.",
    "Describe a cat to someone who has never seen one.",
    "What does a compiler do?",
    "Suggest a name for a bakery.",
    "Why is the sky blue?",
    "List four fruits that are red.",
    "What is the boiling point of water?",
    "Tell me a fun fact about octopuses.",
    "How do I make a cup of tea?",
    "Translate 'good morning' into Spanish.",
    "What is photosynthesis?",
]

TEXT = (
    "The history of the bicycle begins in the early nineteenth century, when inventors in Europe "
    "experimented with two-wheeled machines that riders pushed along with their feet. These early "
    "designs were heavy and uncomfortable, but they showed that a person could balance on two wheels "
    "in a line. Later, pedals were attached to the front wheel, and by the end of the century the "
    "safety bicycle, with two wheels of equal size and a chain driving the rear wheel, had become "
    "popular across the world. Bicycles changed how people travelled to work, gave many women new "
    "independence, and encouraged the building of smoother roads. Today millions of people ride "
    "bicycles every day, for transport, for sport and for pleasure, and cities are adding lanes "
    "that keep cyclists safe from cars. Engineers continue to improve frames, gears and brakes, "
    "while electric motors help riders climb hills and carry heavy loads over long distances."
)


def greedy_outputs(model: str | None, kv_dtype: str, output_len: int) -> tuple[list[list[int]], float]:
    llm = LLM(model, kv_cache_dtype=kv_dtype, max_num_seqs=len(PROMPTS))
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.chat([[{"role": "user", "content": p}] for p in PROMPTS], params)
    return [o.token_ids for o in outs], time.perf_counter() - start


@torch.inference_mode()
def perplexity(engine: LLMEngine, token_ids: list[int], chunk: int) -> float:
    """exp(mean NLL) of ``token_ids[1:]``, fed ``chunk`` tokens per step through the paged cache."""
    owner = "ppl"
    if not engine.kv.allocate(owner, len(token_ids)):
        raise RuntimeError("the KV cache is too small for the perplexity text")
    runner = engine.runner
    table = engine.kv.blocks_of(owner)
    nll = 0.0
    try:
        for start in range(0, len(token_ids), chunk):
            end = min(start + chunk, len(token_ids))
            meta = AttentionMetadata.build(engine.config.block_size, [end - start], [end], [table])
            runner.backend.prepare(meta)
            hidden = runner.model(torch.tensor(token_ids[start:end]), torch.arange(start, end),
                                  runner.kv_cache, runner.backend, meta, runner.kv_scales)
            logp = torch.log_softmax(runner.model.compute_logits(hidden), dim=-1)
            targets = token_ids[start + 1 : end + 1]
            rows = logp[: len(targets)]
            nll -= float(rows.gather(1, torch.tensor(targets)[:, None]).sum())
    finally:
        engine.kv.free(owner)
    return math.exp(nll / (len(token_ids) - 1))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtypes", default="auto,fp8,fp8_e5m2,int8")
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--ppl-chunk", type=int, default=16)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    dtypes = args.dtypes.split(",")
    if dtypes[0] != "auto":
        dtypes.insert(0, "auto")
    rows: list[dict[str, Any]] = []
    reference: list[list[int]] = []
    for kv_dtype in dtypes:
        outs, elapsed = greedy_outputs(args.model, kv_dtype, args.output_len)
        if kv_dtype == "auto":
            reference = outs
        same = sum(a == b for a, b in zip(outs, reference, strict=True))
        prefix = [next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
                  for a, b in zip(outs, reference, strict=True)]
        engine = LLMEngine(args.model, EngineConfig(kv_cache_dtype=kv_dtype))
        ppl = perplexity(engine, engine.tokenizer.encode(TEXT), args.ppl_chunk)
        row = {"kv_cache_dtype": kv_dtype, "identical": same, "prompts": len(PROMPTS),
               "mean_common_prefix": sum(prefix) / len(prefix), "perplexity": ppl,
               "greedy_elapsed_s": elapsed, "num_kv_blocks": engine.kv.num_blocks}
        rows.append(row)
        print(f"{kv_dtype:>9}: identical first {args.output_len} tokens {same}/{len(PROMPTS)}, "
              f"mean common prefix {row['mean_common_prefix']:.1f}, perplexity {ppl:.4f}, "
              f"KV blocks in 512 MiB {engine.kv.num_blocks}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

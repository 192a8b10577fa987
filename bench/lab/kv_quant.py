"""Quantized KV cache quality: greedy agreement and perplexity against full-precision KV.

Greedy agreement: 16 fixed chat prompts, greedy, up to ``--output-len`` tokens each
(stopping at EOS), once per ``--kv-cache-dtype``; a prompt agrees when its output
equals that of the ``auto`` (model dtype) run token for token. One model load: every
KV dtype gets its own cache (``ModelRunner``) over the same weights. The row
``auto-torch`` runs full-precision KV through the torch reference kernel (which
quantized KV uses) instead of the native one: the agreement that kernel noise
alone allows. The row ``bf16-rounded`` is a control: full-precision KV through the
torch kernel with every K/V rounded to bfloat16 before it is stored (what a bf16
KV cache holds), to show how sensitive the model's greedy output is to KV
rounding much finer than fp8's. ``e4m3-rounded`` rounds every K/V element to
fp8 e4m3 with no scale at all (clamped to its +-448 range), reading
the own token rounded too: the error e4m3's 3-bit mantissa brings by itself,
whatever the scaling scheme.

Where an output diverges, the bench also reports the *gap* at the first differing
position: the full-precision run's logprob of its own token minus its logprob of
the token the quantized run chose there (both runs share the context up to that
point). A small gap means the quantized run flipped a near-tie of the
full-precision model; a large one would mean real damage.

Perplexity: a fixed English text, teacher-forced through the engine's model in
chunks of ``--ppl-chunk`` tokens, so every chunk attends to the earlier chunks as
stored in the (quantized) paged cache, as decode does.

    python -m bench.lab.kv_quant [--model PATH] [--dtypes auto,fp8,fp8_e5m2,int8]
        [--output-len 32] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import replace
from typing import Any

import torch

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.kv_sizing import num_kv_blocks
from engine.model_runner import ModelRunner
from kernels import AttentionMetadata, TorchAttentionBackend

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


class RoundedBackend(TorchAttentionBackend):
    """The torch kernel over a full-precision cache, storing K/V rounded to ``rounding``
    element by element (no scales; clamped to its range), own token included."""

    rounding = torch.bfloat16

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor,
                scale: float, kv_scales: torch.Tensor | None = None, *, window: int | None = None,
                sinks: torch.Tensor | None = None, softcap: float | None = None) -> torch.Tensor:
        limit = torch.finfo(self.rounding).max
        k, v = (t.clamp(-limit, limit).to(self.rounding).to(t.dtype) for t in (k, v))
        return super().forward(q, k, v, kv_layer, scale, kv_scales, window=window, sinks=sinks,
                               softcap=softcap)


class E4m3RoundedBackend(RoundedBackend):
    rounding = torch.float8_e4m3fn


CONTROLS: dict[str, type[TorchAttentionBackend]] = {
    "auto-torch": TorchAttentionBackend, "bf16-rounded": RoundedBackend, "e4m3-rounded": E4m3RoundedBackend,
}


def use_kv_dtype(llm: LLM, kv_dtype: str) -> None:
    """Give ``llm`` a fresh KV cache of ``kv_dtype`` (same weights, same block count)."""
    engine = llm.engine
    kv = "auto" if kv_dtype in CONTROLS else kv_dtype
    engine.runner = ModelRunner(engine.runner.model, engine.model_config,
                                replace(engine.config, kv_cache_dtype=kv), engine.kv.num_blocks)
    if kv_dtype in CONTROLS:
        engine.runner.backend = CONTROLS[kv_dtype]()
    engine.kv.pool.reset_prefix_cache()


TOP_LOGPROBS = 20


def greedy_outputs(llm: LLM, output_len: int) -> tuple[list[list[int]], list[list[dict[int, float]]], float]:
    """Token ids, and per position the top-``TOP_LOGPROBS`` logprobs, of one greedy batch."""
    params = SamplingParams(max_tokens=output_len, temperature=0.0, logprobs=TOP_LOGPROBS)
    start = time.perf_counter()
    outs = llm.chat([[{"role": "user", "content": p}] for p in PROMPTS], params)
    tops = [[dict(lp.top) for lp in (o.logprobs or [])] for o in outs]
    return [o.token_ids for o in outs], tops, time.perf_counter() - start


def divergence_gap(out: list[int], ref: list[int], ref_top: list[dict[int, float]]) -> float | None:
    """Reference logprob gap at the first differing position (None when identical).

    ``inf`` when the quantized run's token is outside the reference's top ``TOP_LOGPROBS``
    or one output stopped where the other went on.
    """
    for i, (x, y) in enumerate(zip(out, ref, strict=False)):
        if x != y:
            top = ref_top[i]
            return top[y] - top[x] if x in top and y in top else math.inf
    return None if len(out) == len(ref) else math.inf


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
    parser.add_argument("--dtypes", default="auto,auto-torch,bf16-rounded,e4m3-rounded,fp8,fp8_e5m2,int8")
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--ppl-chunk", type=int, default=16)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    dtypes = [d for d in args.dtypes.split(",") if d != "auto"]
    dtypes.insert(0, "auto")
    rows: list[dict[str, Any]] = []
    reference: list[list[int]] = []
    reference_top: list[list[dict[int, float]]] = []
    llm = LLM(args.model, max_num_seqs=len(PROMPTS), num_kv_blocks=256)
    engine = llm.engine
    text = engine.tokenizer.encode(TEXT)
    for kv_dtype in dtypes:
        use_kv_dtype(llm, kv_dtype)
        outs, tops, elapsed = greedy_outputs(llm, args.output_len)
        if kv_dtype == "auto":
            reference, reference_top = outs, tops
        same = sum(a == b for a, b in zip(outs, reference, strict=True))
        prefix = [next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
                  for a, b in zip(outs, reference, strict=True)]
        gaps = [g for g in (divergence_gap(a, b, t) for a, b, t in zip(outs, reference, reference_top,
                                                                          strict=True)) if g is not None]
        ppl = perplexity(engine, text, args.ppl_chunk)
        budget = num_kv_blocks(engine.model_config, EngineConfig(
            kv_cache_dtype="auto" if kv_dtype in CONTROLS else kv_dtype, kv_cache_memory=2**30))
        row = {"kv_cache_dtype": kv_dtype, "identical": same, "prompts": len(PROMPTS),
               "mean_common_prefix": sum(prefix) / len(prefix), "perplexity": ppl,
               "greedy_elapsed_s": elapsed, "blocks_per_gib": budget,
               "divergence_gaps": sorted(gaps)}
        rows.append(row)
        print(f"{kv_dtype:>10}: identical outputs (up to {args.output_len} tokens) {same}/{len(PROMPTS)}, "
              f"mean common prefix {row['mean_common_prefix']:.1f}, perplexity {ppl:.4f}, "
              f"KV blocks per GiB {budget}, greedy batch {elapsed:.1f} s, "
              f"gaps at divergence {', '.join(f'{g:.3f}' for g in sorted(gaps)) or '-'}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

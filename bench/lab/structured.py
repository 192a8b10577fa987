"""Cost of grammar-constrained decoding in one engine: decode throughput with and without a JSON-schema
constraint, masking time per step, and grammar compile time (cold and cached).

Decode throughput: ``--concurrency`` requests with the same chat prompt, greedy, run until each has its
first token (prefill), then ``--output-len`` more steps are timed; tokens per second count every token
those steps produced. The constrained run uses ``SCHEMA`` (an object holding a list of at least 100
strings), which cannot complete within the run, so both runs decode the same number of tokens.
Masking time is the engine's own ``grammar_mask_seconds`` over the timed steps.

Compile: the tokenizer's one-off conversion for the grammar library, then ``SCHEMA`` compiled cold and
looked up again (cached), each the median of ``--repeats`` fresh grammar caches.

    python -m bench.lab.structured [--model PATH] [--concurrency 1 16] [--output-len 64] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

from engine import LLM, SamplingParams
from engine.sampling_params import StructuredOutput
from engine.structured import Grammars

SCHEMA = {"type": "object", "properties": {
    "cities": {"type": "array", "items": {"type": "string"}, "minItems": 100},
    "country": {"type": "string"}}, "required": ["cities", "country"], "additionalProperties": False}
CONSTRAINT = StructuredOutput("json_schema", json.dumps(SCHEMA))


def decode_run(llm: LLM, prompt: list[int], concurrency: int, output_len: int,
               structured: StructuredOutput | None) -> dict[str, Any]:
    engine = llm.engine
    params = SamplingParams(max_tokens=output_len + 1, temperature=0.0, ignore_eos=True,
                            structured=structured)
    ids = [engine.add_request(prompt, params).request_id for _ in range(concurrency)]
    while any(not engine.requests[i].output_token_ids for i in ids if i in engine.requests):
        engine.step()
    stats = engine.grammars.stats
    mask0, steps0 = stats.mask_seconds, stats.mask_steps
    tokens, steps = 0, 0
    start = time.perf_counter()
    while engine.has_unfinished():
        tokens += sum(len(o.new_token_ids) for o in engine.step())
        steps += 1
    elapsed = time.perf_counter() - start
    mask = stats.mask_seconds - mask0
    return {"constrained": structured is not None, "concurrency": concurrency, "tokens": tokens,
            "steps": steps, "elapsed_s": elapsed, "decode_tok_s": tokens / elapsed,
            "mask_ms_per_step": 1000 * mask / max(1, stats.mask_steps - steps0),
            "mask_share": mask / elapsed}


def compile_times(llm: LLM, repeats: int) -> dict[str, float]:
    engine = llm.engine
    tokenizer, cold, cached = [], [], []
    for _ in range(repeats):
        grammars = Grammars(engine.tokenizer, engine.model_config.vocab_size, engine.eos_token_ids)
        t0 = time.perf_counter()
        grammars.compile(StructuredOutput("regex", "a"))  # converts the tokenizer once
        t1 = time.perf_counter()
        grammars.compile(CONSTRAINT)
        t2 = time.perf_counter()
        grammars.compile(CONSTRAINT)
        t3 = time.perf_counter()
        tokenizer.append(t1 - t0)
        cold.append(t2 - t1)
        cached.append(t3 - t2)
    return {"tokenizer_conversion_ms": 1000 * statistics.median(tokenizer),
            "compile_cold_ms": 1000 * statistics.median(cold),
            "compile_cached_ms": 1000 * statistics.median(cached)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.lab.structured", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model path (default: the built-in SmolLM2-135M)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default=None, metavar="OUT", help="also write the results as JSON")
    args = p.parse_args(argv)
    llm = LLM(args.model, max_num_seqs=max(args.concurrency))
    prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": "List cities as JSON."}])
    llm.generate(prompt, SamplingParams(max_tokens=4, structured=CONSTRAINT))  # warm-up, tokenizer converted
    runs = []
    for c in args.concurrency:
        for structured in (None, CONSTRAINT):
            runs.append(decode_run(llm, prompt, c, args.output_len, structured))
            r = runs[-1]
            print(f"concurrency {c:3d} {'json_schema' if structured else 'free       '}: "
                  f"{r['decode_tok_s']:8.1f} tok/s  mask {r['mask_ms_per_step']:.2f} ms/step "
                  f"({100 * r['mask_share']:.1f}% of the time)")
    for c in args.concurrency:
        free, constrained = (r for r in runs if r["concurrency"] == c)
        share = 100 * constrained["decode_tok_s"] / free["decode_tok_s"]
        print(f"concurrency {c:3d}: constrained throughput {share:.1f}% of free")
    compile_ = compile_times(llm, args.repeats)
    print("grammar: " + ", ".join(f"{k} {v:.2f}" for k, v in compile_.items()))
    if args.json:
        with open(args.json, "w") as f:
            out = {"runs": runs, "compile": compile_, "torch_threads": torch.get_num_threads()}
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()

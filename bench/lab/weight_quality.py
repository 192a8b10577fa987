"""Quality of each weight precision on real text: perplexity over a long document and greedy agreement.

For each ``--runs`` entry ``label=dtype[:activations][@model.gguf]`` (the default model when no file is
given; ``activations``: the products over the GGUF blocks ``auto`` keeps, ``float32`` or ``int8``, by
default ``--gguf-activations``): the perplexity of ``--text`` (default
``/usr/share/common-licenses/GPL-3``, ~9k tokens, present on every Debian machine) read in independent
windows of ``--window`` tokens, each fed ``--chunk`` tokens per step through the paged cache
(``bench.lab.kv_quant.perplexity``), and, against the first entry, the share of identical tokens over
``--output-len`` greedy tokens of ``kv_quant``'s 16 chat prompts.

    python -m bench.lab.weight_quality --runs "float32=float32,Q4_1 blocks=auto,Q4_1 int8=auto:int8"
    python -m bench.lab.weight_quality --runs "float32=float32,Q8_0=auto@/tmp/q8.gguf"
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from bench.lab.kv_quant import greedy_outputs, perplexity
from engine import LLM


def window_perplexity(llm: LLM, ids: list[int], window: int, chunk: int) -> float:
    """exp of the mean NLL over every window (each window's first token is not predicted)."""
    nll, count = 0.0, 0
    for start in range(0, len(ids) - 1, window):
        part = ids[start:start + window]
        if len(part) < 2:
            break
        nll += math.log(perplexity(llm.engine, part, chunk)) * (len(part) - 1)
        count += len(part) - 1
    return math.exp(nll / count)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", required=True,
                        help="label=dtype[:float32|int8][@model.gguf], comma-separated")
    parser.add_argument("--gguf-activations", default="float32", choices=("float32", "int8"),
                        help="the activations of the products over GGUF blocks, where a run names none")
    parser.add_argument("--text", default="/usr/share/common-licenses/GPL-3")
    parser.add_argument("--window", type=int, default=2048)
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    text = Path(args.text).read_text()
    reference: list[list[int]] | None = None
    rows = ["| weights | file | perplexity | identical greedy tokens |", "|---|---|---:|---:|"]
    for run in args.runs.split(","):
        label, spec = run.split("=", 1)
        numerics, _, model = spec.partition("@")
        dtype, _, activations = numerics.partition(":")
        llm = LLM(model or None, dtype=dtype, gguf_activations=activations or args.gguf_activations,
                  num_threads=args.threads, max_num_seqs=16,
                  num_kv_blocks=args.window // 16 + 64)
        try:
            ids = llm.engine.tokenizer.encode(text)
            ppl = window_perplexity(llm, ids, args.window, args.chunk)
            outs, _, _ = greedy_outputs(llm, args.output_len)
        finally:
            llm.close()
        if reference is None:
            reference = outs
        same = sum(a == b for ref, out in zip(reference, outs, strict=True)
                   for a, b in zip(ref, out, strict=False))
        total = sum(len(ref) for ref in reference)
        rows.append(f"| {label} | {Path(model).name if model else 'default'} | {ppl:.3f} | "
                    f"{same / total:.1%} ({same}/{total}) |")
        print(rows[-1], f"({len(ids)} tokens)", flush=True)
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

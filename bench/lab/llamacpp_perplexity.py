"""llama.cpp's perplexity on the text and windows ``bench.lab.weight_quality`` reads, for its table.

Runs in the peers' environment, where ``llama-cpp-python`` is installed (``~/.cache/peers/llamacpp-venv``;
not a pdserve dependency): the GGUF is evaluated by llama.cpp itself, the text tokenized by its own
tokenizer (the same vocabulary), in independent windows of ``--window`` tokens, each window's first token
not predicted; exp of the mean negative log-likelihood.

    ~/.cache/peers/llamacpp-venv/bin/python bench/lab/llamacpp_perplexity.py --model FILE.gguf
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import numpy as np
from llama_cpp import Llama


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--text", default="/usr/share/common-licenses/GPL-3")
    parser.add_argument("--window", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    llm = Llama(model_path=args.model, n_ctx=args.window, n_batch=512, logits_all=True,
                n_threads=args.threads, verbose=False)
    ids = llm.tokenize(Path(args.text).read_text().encode(), add_bos=False, special=False)
    nll, count = 0.0, 0
    for start in range(0, len(ids) - 1, args.window):
        part = ids[start:start + args.window]
        if len(part) < 2:
            break
        llm.reset()
        llm.eval(part)
        logits = np.asarray(llm.scores[: len(part) - 1], dtype=np.float64)
        top = logits.max(axis=1, keepdims=True)
        logp = logits - top - np.log(np.exp(logits - top).sum(axis=1, keepdims=True))
        nll -= float(logp[np.arange(len(part) - 1), part[1:]].sum())
        count += len(part) - 1
    print(f"{Path(args.model).name}: perplexity {math.exp(nll / count):.3f} over {len(ids)} tokens")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

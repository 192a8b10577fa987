"""What tensor parallelism costs on this machine: TP=1 against TP=N on the same cores, same model.

``python -m bench.lab.tensor_parallel [--sizes 1,2] [--threads 2]`` builds (once, cached under
``$PDSERVE_CACHE/bench``) a random-weight Llama of SmolLM2-135M's size whose heads split in two
(hidden 576, 8 query / 2 KV heads of 64, MLP 1536, 30 layers, vocabulary 49,152; SmolLM2's own 9 heads
only split in three), then per TP size runs ``LLM(tensor_parallel_size=N)`` with ``--threads / N``
torch threads per rank (the same cores in total) and prints:

- decode tokens/s at batch 1 and batch 8 (greedy, 64 new tokens after a 32-token prompt),
- prefill tokens/s of one 512-token prompt,
- per decode step on rank 0: the step plan's two broadcasts (``plan ms``) and the forward's collectives
  (``coll ms``: 2 all-reduces per layer, the embedding's, the logits gather), from ``TpGroup``'s counters.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

from engine import LLM, SamplingParams
from engine.loader import cache_root

SHAPE: dict[str, Any] = dict(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=8,
    num_key_value_heads=2, head_dim=64, max_position_embeddings=2048, tie_word_embeddings=True,
    bos_token_id=None, eos_token_id=None, pad_token_id=None,
)


def model_dir() -> Path:
    folder = cache_root() / "bench" / "tp-llama-576-8h"
    if (folder / "config.json").is_file():
        return folder
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**SHAPE)).save_pretrained(str(folder), safe_serialization=True)
    words = ["[UNK]"] + [f"w{i}" for i in range(1, SHAPE["vocab_size"])]  # prompts are token ids anyway
    raw = Tokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    raw.pre_tokenizer = Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="[UNK]").save_pretrained(str(folder))
    return folder


def _prompt(n: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(1, SHAPE["vocab_size"], (n,), generator=gen).tolist()


def measure(folder: Path, size: int, threads: int) -> dict[str, float]:
    llm = LLM(model=str(folder), tensor_parallel_size=size, dtype="float32",
              num_threads=max(threads // size, 1), kv_cache_memory=256 * 1024**2, enable_prefix_caching=False,
              max_num_batched_tokens=512)
    try:
        greedy = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
        llm.generate([_prompt(32, 0)], greedy)  # warm-up
        group = llm.engine.runner.group
        out: dict[str, float] = {"tp": size, "threads_per_rank": max(threads // size, 1)}
        for batch in (1, 8):
            if group is not None:
                group.plan_seconds = group.collective_seconds = 0.0
                group.steps = 0
            start = time.perf_counter()
            outs = llm.generate([_prompt(32, i + 1) for i in range(batch)], greedy)
            elapsed = time.perf_counter() - start
            out[f"decode_tok_s_b{batch}"] = sum(len(o.token_ids) for o in outs) / elapsed
            if group is not None and group.steps:
                out[f"plan_ms_b{batch}"] = 1e3 * group.plan_seconds / group.steps
                out[f"coll_ms_b{batch}"] = 1e3 * group.collective_seconds / group.steps
                out[f"step_ms_b{batch}"] = 1e3 * elapsed / group.steps
        start = time.perf_counter()
        llm.generate([_prompt(512, 99)], SamplingParams(max_tokens=1, temperature=0.0))
        out["prefill_tok_s_512"] = 512 / (time.perf_counter() - start)
        return out
    finally:
        llm.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.lab.tensor_parallel",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="1,2", help="TP sizes to run, comma-separated (default: 1,2)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads in all, split over the ranks")
    args = parser.parse_args(argv)
    folder = model_dir()
    for size in (int(s) for s in args.sizes.split(",")):
        figures = measure(folder, size, args.threads)
        print(json.dumps({k: round(v, 3) for k, v in figures.items()}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

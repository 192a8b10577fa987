"""Offline throughput: pdserve's ``LLM.generate`` against Hugging Face transformers.

Both run the same batch of prompts (seeded random token ids, exactly
``--input-len`` each, no special tokens), greedy, exactly ``--output-len`` new
tokens each, in the same dtype on the same machine. Output tokens/s counts only
generated tokens over the wall time of the whole batch (prefill included).

    python -m bench.lab.offline [--model PATH] [--num-prompts 64] [--input-len 256]
        [--output-len 128] [--dtype float32] [--skip-hf] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

DESCRIPTION = "Offline throughput: pdserve's LLM.generate against Hugging Face transformers."
WARMUP_PROMPTS = 2
WARMUP_TOKENS = 4


@dataclass(frozen=True)
class RunResult:
    system: str
    elapsed_s: float
    output_tokens: int
    mean_ttft_s: float | None = None

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.elapsed_s


def resolve_model(model: str | None) -> Path:
    if model is not None:
        return Path(model)
    from engine.loader import default_model_path

    return Path(default_model_path())


def load_hf_tokenizer(path: Path) -> Any:
    from transformers import AutoTokenizer

    if path.is_file():
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return AutoTokenizer.from_pretrained(str(path))


def make_prompts(tokenizer: Any, num: int, length: int, seed: int) -> list[list[int]]:
    """``num`` prompts of exactly ``length`` ids drawn from the vocabulary minus special/added tokens."""
    excluded = set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {}))
    vocab = np.array([i for i in range(len(tokenizer)) if i not in excluded], dtype=np.int64)
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.choice(vocab, size=length)] for _ in range(num)]


def run_engine(path: Path, prompts: list[list[int]], warmup: list[list[int]], output_len: int,
               dtype: str, block_size: int) -> tuple[RunResult, list[list[int]]]:
    from engine import LLM, SamplingParams

    per_seq_blocks = math.ceil((len(prompts[0]) + output_len) / block_size)
    llm = LLM(model=str(path), dtype=dtype, block_size=block_size,
              num_kv_blocks=per_seq_blocks * len(prompts) + 1,
              max_num_seqs=len(prompts))
    llm.generate(warmup, SamplingParams(max_tokens=WARMUP_TOKENS, temperature=0.0, ignore_eos=True))
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    ttfts = [o.metrics.ttft for o in outs if o.metrics.ttft is not None]
    result = RunResult("pdserve", elapsed, sum(len(o.token_ids) for o in outs),
                       sum(ttfts) / len(ttfts) if ttfts else None)
    return result, [list(o.token_ids) for o in outs]


def run_transformers(path: Path, tokenizer: Any, prompts: list[list[int]], warmup: list[list[int]],
                     output_len: int, dtype: str) -> tuple[RunResult, list[list[int]]]:
    import transformers
    from transformers import AutoModelForCausalLM

    torch_dtype = getattr(torch, dtype)
    model: Any
    if path.is_file():
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch_dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch_dtype)
    model.eval()
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    def generate(batch: list[list[int]], new_tokens: int) -> torch.Tensor:
        ids = torch.tensor(batch, dtype=torch.long)
        with torch.inference_mode():
            out: torch.Tensor = model.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=pad,
            )
        return out[:, ids.shape[1]:]

    generate(warmup, WARMUP_TOKENS)
    start = time.perf_counter()
    new = generate(prompts, output_len)
    elapsed = time.perf_counter() - start
    result = RunResult(f"transformers {transformers.__version__}", elapsed, int(new.numel()))
    return result, new.tolist()


def machine_info() -> dict[str, Any]:
    return {
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "processor": platform.processor() or None,
    }


def markdown(args: argparse.Namespace, results: list[RunResult], info: dict[str, Any]) -> str:
    lines = [
        "| system | prompts | input len | output len | dtype | elapsed (s) | mean TTFT (s) | output tok/s |",
        "|---|---:|---:|---:|---|---:|---:|---:|",
    ]
    for r in results:
        ttft = f"{r.mean_ttft_s:.2f}" if r.mean_ttft_s is not None else "-"
        lines.append(f"| {r.system} | {args.num_prompts} | {args.input_len} | {args.output_len} "
                     f"| {args.dtype} | {r.elapsed_s:.1f} | {ttft} | {r.output_tokens_per_s:.1f} |")
    if len(results) == 2:
        lines.append(f"\npdserve / transformers output tok/s: "
                     f"{results[0].output_tokens_per_s / results[1].output_tokens_per_s:.2f}x")
    lines.append(f"\nmachine: {info['cpu_count']} cores (os.cpu_count), {info['torch_threads']} torch "
                 f"threads, torch {info['torch']}, Python {info['python']}, {info['machine']}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.lab.offline", description=DESCRIPTION)
    p.add_argument("--model", default=None,
                   help="Hugging Face model folder or .gguf file (default: the built-in SmolLM2 GGUF)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    p.add_argument("--skip-hf", action="store_true", help="run pdserve only")
    p.add_argument("--json", type=Path, default=None, metavar="OUT", help="also write the results here")
    args = p.parse_args(argv)
    for name in ("num_prompts", "input_len", "output_len"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    path = resolve_model(args.model)
    tokenizer = load_hf_tokenizer(path)
    prompts = make_prompts(tokenizer, args.num_prompts, args.input_len, args.seed)
    warmup = make_prompts(tokenizer, WARMUP_PROMPTS, args.input_len, args.seed + 1)

    ours, our_tokens = run_engine(path, prompts, warmup, args.output_len, args.dtype, args.block_size)
    results = [ours]
    identical = None
    if not args.skip_hf:
        ref, ref_tokens = run_transformers(path, tokenizer, prompts, warmup, args.output_len, args.dtype)
        results.append(ref)
        identical = sum(a == b for a, b in zip(our_tokens, ref_tokens, strict=True))

    info = machine_info()
    print(markdown(args, results, info))
    if identical is not None:
        print(f"identical greedy outputs: {identical}/{len(prompts)}")
    if args.json is not None:
        record = {
            "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "model": str(path),
            "results": [asdict(r) | {"output_tokens_per_s": r.output_tokens_per_s} for r in results],
            "identical_greedy_outputs": identical,
            "machine": info,
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

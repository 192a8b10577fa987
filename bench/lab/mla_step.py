"""Decode steps of a DeepSeek-V2-Lite-shaped model against the read floor of what they read.

DeepSeek-V2-Lite's published widths (``V2_LITE``: hidden 2048, 16 heads, no query LoRA, a latent of 512 +
64 rotary values, a dense first layer of 10,944, then 64 routed experts of 1,408, top 6 of a softmax, and
2 shared ones; vocabulary 102,400, untied), random float32 weights built by transformers and saved once
under ``$PDSERVE_CACHE/bench`` (``bench.lab.handoff_bytes.model_dir``; nothing from a hub), with fewer
layers than its 27 (``--layers``, default 3: the dense layer and two mixture layers), so that the weights
fit this host's memory: the 27 layers are 15.7 B parameters, 63 GB in float32. YaRN's rope scaling is
left out: it changes the rotary tables, not what a step reads.

Each step is timed and floored as ``bench.lab.moe_step`` does it (the same harness and the same floor:
the weights a step reads whole, the attention's ``kv_b_proj`` among them, + one expert's bytes x the
distinct experts each mixture layer read + the latent rows attended over, 576 values a token a layer, /
the read bandwidth of a torch ``sum``). Decode rows take the absorbed form (``kernels/mla.py``). The
section between ``<!-- bench-mla-step:begin -->`` and ``<!-- bench-mla-step:end -->`` of ``--doc`` is
rewritten with the host, the command and the date.

    python -m bench.lab.mla_step [--layers 3] [--batches 1,16] [--context 512] [--repeats 10]
        [--threads N] [--bw-bytes B] [--doc PATH | --no-doc]
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path
from typing import Any

import torch

from bench.lab.handoff_bytes import model_dir
from bench.lab.moe_step import WARM_STEPS, add_step_arguments, engine_for, positive_list, run_row, table
from bench.sections import machine, opening, publish
from engine.models.size import parameter_count

BEGIN, END = "<!-- bench-mla-step:begin -->", "<!-- bench-mla-step:end -->"
ROOT = Path(__file__).resolve().parents[2]
V2_LITE: dict[str, Any] = {
    "model_type": "deepseek_v2", "architectures": ["DeepseekV2ForCausalLM"], "vocab_size": 102400,
    "hidden_size": 2048, "intermediate_size": 10944, "moe_intermediate_size": 1408,
    "num_attention_heads": 16, "num_key_value_heads": 16, "n_routed_experts": 64, "n_shared_experts": 2,
    "num_experts_per_tok": 6, "first_k_dense_replace": 1, "moe_layer_freq": 1, "q_lora_rank": None,
    "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "topk_method": "greedy", "n_group": 1, "topk_group": 1, "norm_topk_prob": False,
    "routed_scaling_factor": 1.0, "scoring_func": "softmax", "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "max_position_embeddings": 8192, "tie_word_embeddings": False, "bos_token_id": None,
    "eos_token_id": None, "pad_token_id": None,
}


def v2_lite(layers: int) -> dict[str, Any]:
    """``V2_LITE`` with ``layers`` decoder layers (the first dense, the rest mixtures)."""
    return {**V2_LITE, "num_hidden_layers": layers}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.lab.mla_step", description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=3, help="decoder layers, the first dense (default: 3)")
    add_step_arguments(p)
    p.add_argument("--doc", type=Path, default=ROOT / "docs" / "benchmarks.md", help="the file to update")
    p.add_argument("--no-doc", action="store_true", help="print the section, leave --doc alone")
    return p


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    args.batches = positive_list(args.batches, "--batches", p)
    if args.layers < 2:
        p.error("--layers must be >= 2 (the dense layer and at least one mixture layer)")
    counts = {"--context": args.context, "--repeats": args.repeats, "--bw-bytes": args.bw_bytes}
    for flag, value in counts.items():
        if value < 1:
            p.error(f"{flag} must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    command = "python -m bench.lab.mla_step " + shlex.join(argv if argv is not None else sys.argv[1:])
    started = machine()
    folder = model_dir(v2_lite(args.layers))
    config_latent = V2_LITE["kv_lora_rank"] + V2_LITE["qk_rope_head_dim"]
    engine = engine_for(folder, args, args.layers * config_latent * 4)
    count = parameter_count(engine.model_config)
    rows = []
    for batch in args.batches:
        rows.append(run_row(engine, "deepseek_v2_lite", batch, args.context, args.repeats, args.bw_bytes))
        print(table(rows[-1:])[-1], flush=True)
    title = "Latent attention and DeepSeek's experts against what a step reads"
    lines = opening(BEGIN, title, command.strip(), started, f"torch threads: {torch.get_num_threads()}",
                    args.repeats)
    lines += [f"DeepSeek-V2-Lite's widths with {args.layers} of its 27 layers (`bench/lab/mla_step.py`), "
              f"random float32 weights: {count.total / 1e9:.2f} B parameters, {count.active / 1e9:.2f} B "
              f"active per token; forward path: {engine.runner.model.execution_path}. Decode rows attend in "
              f"the absorbed form over the latent. {args.context} prompt tokens per request, {WARM_STEPS} "
              f"warm-up steps, {args.repeats} steps timed one by one; floor as in the mixture-of-experts "
              "table above (weights read whole + one expert's bytes x the distinct experts read + the "
              "latent rows attended over, / a torch `sum`'s read bandwidth).", "",
              *table(rows), "", END]
    publish("\n".join(lines), args.doc, not args.no_doc, BEGIN, END)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

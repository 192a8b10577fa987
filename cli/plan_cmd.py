"""``pdserve plan``, the command: its flags, and the plan as a two-column table, its KV groups and the budget
sized for every KV storage dtype side by side, or as JSON (``cli/plan.py`` computes the ``Plan``)."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path

from cli.engine_args import DTYPES, size
from cli.plan import DEFAULT_DEVICE_MEMORY, Plan, make_plan, read_model_config, read_quant


def _gib(n: int) -> str:
    return f"{n / 1024**3:,.2f} GiB"


def format_plan(plan: Plan) -> str:
    """The plan as a two-column table, then concurrent sequences per context length."""
    if plan.device_memory is not None:
        budget_how = (f"{_gib(plan.device_memory)} x {plan.gpu_memory_utilization} - weights")
    else:
        budget_how = "--kv-cache-memory"
    tp = plan.tensor_parallel_size
    per = " per device" if tp > 1 else ""
    rows = [
        ("model", f"{plan.model} ({plan.num_layers} layers, " + (
            f"{plan.num_kv_heads} KV heads x {plan.head_dim})" if not plan.latent_dim
            else f"a latent of {plan.latent_dim} values per token per layer)")),
        ("parameters", f"{plan.parameters / 1e9:,.2f} B" + _active(plan)),
        ("tensor parallel", f"{tp} devices, {plan.kv_heads_per_device} KV heads per device"
                            + (" (replicated)" if plan.kv_heads_per_device * tp > plan.num_kv_heads else "")),
        (f"weights{per}", f"{_gib(plan.weight_bytes)} ({plan.dtype}"
                          + (", quantized matrices as their records)" if plan.kept_records else ")")),
        ("KV cache dtype", plan.kv_cache_dtype),
        (f"KV bytes per token{per}", f"{plan.kv_bytes_per_token:,}"),
        *_group_rows(plan, per),
        ("KV block", f"{plan.block_size} tokens x {plan.kv_block_slots} layers = "
                     f"{plan.kv_block_bytes:,} bytes"
                     + (f" (incl. {scales:,} bytes of scales)" if (scales := _scale_bytes(plan)) else "")),
        (f"KV budget{per}", f"{_gib(plan.kv_budget_bytes)} ({plan.kv_budget_bytes:,} bytes; {budget_how})"),
        ("KV blocks", f"{plan.num_kv_blocks:,}"),
        ("KV tokens", f"{plan.kv_tokens:,}"),
        ("max model len", f"{plan.max_model_len:,} tokens = {plan.blocks_per_sequence:,} blocks"),
        ("concurrent sequences", f"{plan.concurrent_sequences:,} at {plan.max_model_len:,} tokens"),
    ]
    width = max(len(k) for k, _ in rows)
    lines = [f"{plan.role} workers (tensor parallel {tp})", ""] if plan.role else []
    lines += [f"{k:<{width}}  {v}" for k, v in rows]
    lines += ["", f"{'context length':>14}  {'sequences':>10}"]
    lines += [f"{n:>14,}  {s:>10,}" for n, s in plan.sequences_at.items()]
    if plan.by_kv_dtype:
        lines += ["", *format_dtype_table(plan)]
    if plan.kv_budget_bytes <= 0:
        lines.append("\nthe weights alone exceed the usable device memory: no room for KV")
    return "\n".join(lines)


def _group_rows(plan: Plan, per: str) -> list[tuple[str, str]]:
    """One row per kind of layer when the model has more than one (or a sliding window)."""
    groups = plan.kv_groups or []
    if len(groups) < 2 and all(g.window is None for g in groups):
        return []
    rows = []
    for g in groups:
        name = f"  {g.attention} layers" + (f" (window {g.window:,})" if g.window else "")
        value = (f"{g.layers} layers in {g.groups} KV group{'s' if g.groups > 1 else ''}: "
                 f"{g.kv_bytes_per_token:,} bytes per token{per}")
        rows.append((name, value + (f", at most {g.window:,} tokens a sequence" if g.window else "")))
    return rows


def _scale_bytes(plan: Plan) -> int:
    """Bytes of a block's scales: the block less its codes (``kv_block_slots`` layers of them)."""
    slots = plan.kv_block_slots or plan.num_layers
    codes = plan.block_size * plan.kv_bytes_per_token // plan.num_layers * slots
    return plan.kv_block_bytes - codes


def _active(plan: Plan) -> str:
    """A mixture of experts' active share, when it has one."""
    if plan.active_parameters >= plan.parameters:
        return ""
    return f", {plan.active_parameters / 1e9:,.2f} B active per token ({_gib(plan.active_weight_bytes)})"


def _per_token(x: float) -> str:
    return f"{x:,.0f}" if x == int(x) else f"{x:,.2f}"


def format_dtype_table(plan: Plan) -> list[str]:
    """The same budget at every KV dtype, one row each; ``*`` marks ``--kv-cache-dtype``."""
    assert plan.by_kv_dtype is not None
    head = ["KV dtype", "bytes/token", "block bytes", "blocks", "tokens", f"seqs@{plan.max_model_len:,}"]
    if plan.kv_offload_bytes is not None:
        head += ["host blocks", "host tokens"]
    if plan.kv_offload_disk_bytes is not None:
        head += ["disk blocks", "disk tokens"]
    rows = []
    for c in plan.by_kv_dtype:
        row = [f"{'*' if c.selected else ' '} {c.kv_cache_dtype}", _per_token(c.block_bytes_per_token),
               f"{c.kv_block_bytes:,}", f"{c.num_kv_blocks:,}", f"{c.kv_tokens:,}",
               f"{c.concurrent_sequences:,}"]
        if c.host_blocks is not None and c.host_tokens is not None:
            row += [f"{c.host_blocks:,}", f"{c.host_tokens:,}"]
        if c.disk_blocks is not None and c.disk_tokens is not None:
            row += [f"{c.disk_blocks:,}", f"{c.disk_tokens:,}"]
        rows.append(row)
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]

    def line(cells: list[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths,
                                                                                             strict=True)))

    sizes = (("host", plan.kv_offload_bytes), ("disk", plan.kv_offload_disk_bytes))
    tiers = [f"{name} tier {n:,} bytes" for name, n in sizes if n is not None]
    title = ["KV capacity per dtype, same budget (* = --kv-cache-dtype; bytes/token include the scales)"]
    if tiers:
        title.append("offload: " + ", ".join(tiers) + " (whole blocks of each dtype)")
    return [*title, line(head), *(line(r) for r in rows)]


def add_plan_args(parser: argparse.ArgumentParser) -> None:
    from engine.kv_sizing import KV_CACHE_DTYPES

    parser.add_argument("model", nargs="?", default=None, metavar="MODEL",
                        help="a Hugging Face model folder, a .gguf file or a bare config.json "
                             "(default: the built-in SmolLM2 GGUF)")
    parser.add_argument("--dtype", choices=("auto", *DTYPES), default="auto",
                        help="dtype the weights are held in: auto (the engine's default) holds them in "
                             "bfloat16 as on CUDA, with an fp8 checkpoint's codes, MXFP4 experts and a "
                             "GGUF's blocks as their records; an explicit dtype dequantizes them")
    parser.add_argument("--kv-cache-dtype", choices=("auto", *KV_CACHE_DTYPES), default="auto",
                        help="dtype of the KV cache; auto follows --dtype")
    parser.add_argument("--device-memory", type=size, default=DEFAULT_DEVICE_MEMORY, metavar="SIZE",
                        help="memory of one device, e.g. 80G")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9, metavar="F",
                        help="fraction of device memory the engine may use, in (0, 1]")
    parser.add_argument("--kv-cache-memory", type=size, default=None, metavar="SIZE",
                        help="a KV budget in bytes instead of device memory minus weights (as the CPU "
                             "engine's --kv-cache-memory)")
    parser.add_argument("--weight-memory", type=size, default=None, metavar="SIZE",
                        help="bytes the weights take, all devices together (split evenly over "
                             "tensor-parallel devices; default: what one device holds under --dtype)")
    parser.add_argument("--max-model-len", type=int, default=None, metavar="N",
                        help="context length of one sequence (default: the model's)")
    parser.add_argument("--block-size", type=int, default=16, metavar="N",
                        help="tokens per KV block, a power of two")
    parser.add_argument("--kv-offload-bytes", type=size, default=None, metavar="SIZE",
                        help="also size a host offload tier of SIZE bytes (as serve's --kv-offload-bytes): "
                             "its blocks and tokens per KV dtype")
    parser.add_argument("--kv-offload-disk-bytes", type=size, default=None, metavar="SIZE",
                        help="also size a disk offload tier of SIZE bytes (as serve's "
                             "--kv-offload-disk-bytes with --kv-offload-dir)")
    parser.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                        help="devices one worker spans (tensor parallelism): weights, KV and blocks per "
                             "device")
    parser.add_argument("--prefill-tp", type=int, default=None, metavar="N",
                        help="plan prefill workers at tensor parallelism N (one plan per role)")
    parser.add_argument("--decode-tp", type=int, default=None, metavar="N",
                        help="plan decode workers at tensor parallelism N (one plan per role)")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")


def run_plan(args: argparse.Namespace) -> int:
    from engine.loader import resolve_model

    if not 0.0 < args.gpu_memory_utilization <= 1.0:
        raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {args.gpu_memory_utilization}")
    if args.block_size <= 0 or args.block_size & (args.block_size - 1):
        raise ValueError(f"--block-size must be a positive power of two, got {args.block_size}")
    if args.max_model_len is not None and args.max_model_len < 1:
        raise ValueError("--max-model-len must be at least 1")
    path = Path(resolve_model(args.model)).expanduser()
    model = read_model_config(path)
    quant, gguf = read_quant(path), path if path.suffix.lower() == ".gguf" else None
    sizes: dict[str | None, int] = {None: args.tensor_parallel_size}
    if args.prefill_tp is not None or args.decode_tp is not None:
        sizes = {"prefill": args.prefill_tp or 1, "decode": args.decode_tp or 1}
    plans: dict[str | None, Plan] = {}
    for role, tp in sizes.items():
        flag = f"--{role}-tp" if role else "--tensor-parallel-size"
        try:
            plans[role] = make_plan(
                model, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype, block_size=args.block_size,
                device_memory=args.device_memory, gpu_memory_utilization=args.gpu_memory_utilization,
                kv_cache_memory=args.kv_cache_memory, max_model_len=args.max_model_len,
                weight_memory=args.weight_memory, kv_offload_bytes=args.kv_offload_bytes,
                kv_offload_disk_bytes=args.kv_offload_disk_bytes, tensor_parallel_size=tp, role=role,
                quant=quant, gguf=gguf)
        except ValueError as exc:
            raise ValueError(f"{flag} {tp}: {exc}") from None
    if args.json:
        out = {role: asdict(p) for role, p in plans.items()}
        print(json.dumps(out.get(None) or out))
    else:
        print("\n\n".join(format_plan(p) for p in plans.values()))
    return 0

"""Decode steps of a mixture of experts against the read floor of the experts they read, beside dense
models of the same active size.

For each model of ``--models`` (``bench/lab/moe_models.py``: random weights, float32, built once by
transformers from a config and cached) and each batch of ``--batches``, that many requests of
``--context`` prompt tokens are prefilled, two decode steps warm up, then ``--repeats`` decode steps are
timed one by one with ``bench.lab.step_profile``'s harness (``timed_step``: schedule, metadata, forward,
sampling and output). Per step:

- bytes = the weights a step reads whole (attention, norms, routers, dense MLPs, the tied embedding and
  LM head), as they are held (float32 panels, or an fp8 model's codes) + one expert's products x the
  distinct experts the step's tokens were routed to, summed over
  the mixture layers (counted from the routing itself, ``MoE.on_route``) + the KV bytes of every token
  the step's rows attend over;
- floor = bytes / the read bandwidth of ``step_profile.read_bandwidth`` (a torch ``sum`` over
  ``--bw-bytes``, best of 5), measured right before each row's steps.

Each row gives the median step and its range, the median floor, the median of the per-step ratios step /
floor and their range, and the distinct experts read per mixture layer (mean over the layers, median
over the steps) beside what uniformly random routing would read, ``E (1 - (1 - k/E)^rows)``. The section
between ``<!-- bench-moe-step:begin -->`` and ``<!-- bench-moe-step:end -->`` of ``--doc`` is rewritten
(``bench/sections.py``) with the host, the command and the date.

    python -m bench.lab.moe_step [--models qwen3_moe,qwen3,llama] [--batches 1,16] [--context 512]
        [--repeats 10] [--threads N] [--hidden 1024 --layers 16 --experts 24 ...] [--doc PATH | --no-doc]
        [--json out.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import shlex
import statistics
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Protocol

import torch

from bench.lab.moe_models import MODELS, QUANTIZED, Shape, model_dir
from bench.lab.step_profile import read_bandwidth, start_scenario, timed_step, weight_bytes
from bench.sections import machine, opening, publish
from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.layers.moe import MoE
from engine.models.causal_lm import CausalLM
from engine.models.size import parameter_count

BEGIN, END = "<!-- bench-moe-step:begin -->", "<!-- bench-moe-step:end -->"
ROOT = Path(__file__).resolve().parents[2]
WARM_STEPS = 2
SHAPE_HELP = {"hidden": "hidden size", "layers": "decoder layers", "heads": "query heads",
              "kv_heads": "KV heads", "head_dim": "head dimension", "experts": "experts per mixture layer",
              "expert_intermediate": "each expert's intermediate size", "top_k": "experts per token",
              "dense_intermediate": "the dense models' MLP; 0: top-k x expert-intermediate",
              "vocab": "vocabulary"}


def distinct_experts(counts: Sequence[int]) -> int:
    """How many experts a forward read, from each expert's token count in it."""
    return sum(1 for c in counts if c)


def uniform_distinct(experts: int, top_k: int, rows: int) -> float:
    """The expected distinct experts of ``rows`` tokens that each pick ``top_k`` of ``experts`` at random."""
    return experts * (1 - (1 - top_k / experts) ** rows)


@dataclass(frozen=True)
class WeightSplit:
    """A model's weight bytes by what a decode step reads of them: ``shared`` whole every step, ``expert``
    per expert read (every mixture layer's experts are one size), ``embedding_row`` per row of an untied
    embedding (0 when tied: the LM head reads the table whole)."""

    shared: int
    expert: int = 0
    embedding_row: int = 0

    def step_bytes(self, distinct: Sequence[int], rows: int, kv_bytes: int) -> int:
        """Bytes a step reads: ``distinct`` experts per mixture layer, ``rows`` tokens, ``kv_bytes`` of KV."""
        return self.shared + self.expert * sum(distinct) + self.embedding_row * rows + kv_bytes


def mixtures(model: CausalLM) -> list[MoE]:
    return [layer.mlp for layer in model.decoder_layers() if isinstance(layer.mlp, MoE)]


class HeldProduct(Protocol):
    """What ``held_bytes`` reads of a ``kernels.linear.PreparedLinear``."""

    @property
    def kind(self) -> object: ...  # a kernels.gguf_blocks.BlockKind, or None for a float product

    @property
    def packed(self) -> torch.Tensor | None: ...

    @property
    def out_features(self) -> int: ...

    @property
    def in_features(self) -> int: ...


def held_bytes(linear: HeldProduct) -> int:
    """The bytes a product reads: the records of kept codes (an fp8 checkpoint's, GGUF blocks), else its
    float32 matrix."""
    if linear.kind is not None and linear.packed is not None:
        return linear.packed.numel() * linear.packed.element_size()
    return linear.out_features * linear.in_features * 4


def held_total(engine: LLMEngine) -> int:
    """``step_profile.weight_bytes`` (every distinct parameter by its shape) with each matrix kept as codes
    counted as its records."""
    model = engine.runner.model
    kept = [lin for lin in model.prepared_linears() if lin.kind is not None]
    return weight_bytes(engine) + sum(held_bytes(lin) - 4 * lin.out_features * lin.in_features
                                      for lin in kept)


def weight_split(model: CausalLM, total: int) -> WeightSplit:
    """``total`` (the bytes the weights hold, ``held_total``) split as a step reads it: each expert's
    products as held (float32, or kept codes) and its biases."""
    stacks = expert = 0
    for moe in mixtures(model):
        biases = [p for p in (moe.b13, moe.b2) if p is not None]
        per_expert = [held_bytes(a) + held_bytes(b) + sum(p[e].numel() * p.element_size() for p in biases)
                      for e, (a, b) in enumerate(zip(moe.w13_linears, moe.w2_linears, strict=True))]
        stacks += sum(per_expert)
        expert = per_expert[0]
    shared, row = total - stacks, 0
    if model.lm_head is not model.embed_tokens:
        table = model.embed_tokens
        shared -= table.numel() * table.element_size()
        row = table.shape[1] * table.element_size()
    return WeightSplit(shared, expert, row)


class ExpertReads:
    """The distinct experts each mixture layer read, one list per step (``start_step`` before each),
    from the layers' ``on_route`` calls (``observing``)."""

    def __init__(self) -> None:
        self.steps: list[list[int]] = []

    def start_step(self) -> None:
        self.steps.append([])

    def record(self, counts: list[int]) -> None:
        self.steps[-1].append(distinct_experts(counts))


@contextmanager
def observing(moes: Sequence[MoE]) -> Iterator[ExpertReads]:
    """Count the experts ``moes`` read while the block runs; the hooks are off again after it."""
    reads = ExpertReads()
    for moe in moes:
        moe.on_route = reads.record
    try:
        yield reads
    finally:
        for moe in moes:
            moe.on_route = None


@dataclass(frozen=True)
class StepSample:
    seconds: float
    bytes: int
    distinct: tuple[int, ...]  # per mixture layer; empty for a dense model


@dataclass(frozen=True)
class Row:
    model: str
    batch: int
    bandwidth: float  # bytes/s
    experts: int  # per mixture layer; 0 for a dense model
    top_k: int
    samples: tuple[StepSample, ...]

    def floors(self) -> list[float]:
        return [s.bytes / self.bandwidth for s in self.samples]

    def ratios(self) -> list[float]:
        return [s.seconds / f for s, f in zip(self.samples, self.floors(), strict=True)]

    def experts_read(self) -> list[float]:
        """Per step, the mean over the mixture layers of the distinct experts read."""
        return [sum(s.distinct) / len(s.distinct) for s in self.samples if s.distinct]


@dataclass(frozen=True)
class ModelInfo:
    name: str
    parameters: int
    active: int
    path: str  # the forward path the engine takes (``CausalLM.execution_path``)
    held: int = 0  # bytes the weights hold (``held_total``)


def kv_read_bytes(engine: LLMEngine) -> int:
    """KV bytes the next decode step attends over: every token of every running request, its new one
    included."""
    per_token = engine.model_config.kv_bytes_per_token(engine.config.kv_torch_dtype.itemsize)
    return per_token * sum(r.num_tokens for r in engine.requests.values())


def run_row(engine: LLMEngine, name: str, batch: int, context: int, repeats: int, bw_bytes: int) -> Row:
    """``repeats`` decode steps of ``batch`` requests at ``context`` tokens, each timed and floored."""
    model = engine.runner.model
    split = weight_split(model, held_total(engine))
    start_scenario(engine, batch, context)
    while any(r.num_computed_tokens < len(r.prompt_token_ids) for r in engine.requests.values()):
        engine.step()
    for _ in range(WARM_STEPS):
        engine.step()
    bandwidth = read_bandwidth(bw_bytes)
    moes = mixtures(model)
    samples = []
    with observing(moes) as reads:
        for _ in range(repeats):
            kv = kv_read_bytes(engine)
            reads.start_step()
            seconds = sum(timed_step(engine).values())
            distinct = tuple(reads.steps[-1])
            samples.append(StepSample(seconds, split.step_bytes(distinct, batch, kv), distinct))
    moe = engine.model_config.moe
    return Row(name, batch, bandwidth, moe.num_experts if moe and moes else 0, moe.top_k if moe else 0,
               tuple(samples))


def _ms(values: Sequence[float]) -> str:
    return f"{statistics.median(values) * 1e3:.1f} ({min(values) * 1e3:.1f}-{max(values) * 1e3:.1f})"


def table(rows: Sequence[Row]) -> list[str]:
    head = ("| model | batch | step ms, median (range) | floor ms | step / floor (range) | "
            "experts read per layer | uniform routing | read GB/s |")
    lines = [head, "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        ratios = r.ratios()
        ratio = f"**{statistics.median(ratios):.2f}x** ({min(ratios):.2f}-{max(ratios):.2f})"
        read = r.experts_read()
        experts = (f"{statistics.median(read):.1f} of {r.experts} ({min(read):.1f}-{max(read):.1f})"
                   if read else "-")
        uniform = f"{uniform_distinct(r.experts, r.top_k, r.batch):.1f}" if read else "-"
        lines.append(f"| {r.model} | {r.batch} | {_ms([s.seconds for s in r.samples])} | "
                     f"{statistics.median(r.floors()) * 1e3:.1f} | {ratio} | {experts} | {uniform} | "
                     f"{r.bandwidth / 1e9:.1f} |")
    return lines


def render(rows: Sequence[Row], infos: dict[str, ModelInfo], shape: Shape, context: int, repeats: int,
           bw_bytes: int, started: str, command: str) -> str:
    s = shape
    lines = opening(BEGIN, "A mixture of experts against the experts it reads", command, started,
                    f"torch threads: {torch.get_num_threads()}", repeats)
    lines += [f"Random float32 weights built by transformers from a config (`bench/lab/moe_models.py`): "
              f"hidden {s.hidden}, {s.layers} layers, {s.heads} query / {s.kv_heads} KV heads of "
              f"{s.head_dim}, vocabulary {s.vocab:,} (tied). `qwen3_moe`: every layer {s.experts} experts of "
              f"{s.expert_intermediate}, top {s.top_k} (renormalised); `qwen3` and `llama`: a dense MLP of "
              f"{s.dense_mlp} (`llama` without q/k norms); `qwen3_moe_fp8`: `qwen3_moe`'s attention and "
              "experts stored as fp8 codes with per-channel scales, served under `--dtype auto` (the codes "
              "multiplied as stored, 36 bytes per 32 weights; the rest float32). Weights MB: every "
              "parameter at 4 bytes, a matrix kept as codes at its records' bytes.", "",
              "| model | parameters | active per token | weights MB | forward path |",
              "|---|---:|---:|---:|---|"]
    lines += [f"| {i.name} | {i.parameters / 1e6:.1f} M | {i.active / 1e6:.1f} M | "
              f"{i.held / 1e6:,.0f} | {i.path} |" for i in infos.values()]
    lines += ["", f"Decode steps at {context} prompt tokens per request, {WARM_STEPS} warm-up steps, then "
              f"{repeats} steps timed one by one (`bench.lab.step_profile`'s phases summed). Floor = "
              "(weights read whole + one expert's bytes x the distinct experts each mixture layer's tokens "
              "were routed to in that step + KV bytes attended over) / the read bandwidth of a torch `sum` "
              f"over {bw_bytes / 1024**3:.2g} GiB (best of 5), measured before each row. `uniform routing`: "
              "the distinct experts random top-k picks would read, E (1 - (1 - k/E)^batch).", ""]
    return "\n".join([*lines, *table(rows), "", END])


def positive_list(text: str, flag: str, parser: argparse.ArgumentParser) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        parser.error(f"{flag}: expected comma-separated integers, got {text!r}")
    if not values or min(values) < 1:
        parser.error(f"{flag}: every value must be >= 1, got {text!r}")
    return values


def add_step_arguments(p: argparse.ArgumentParser) -> None:
    """The decode-step flags ``run_row`` and ``engine_for`` read (shared with ``bench.lab.mla_step``)."""
    p.add_argument("--batches", default="1,16", help="decode batch sizes (default: 1,16)")
    p.add_argument("--context", type=int, default=512, help="prompt tokens per request (default: 512)")
    p.add_argument("--repeats", type=int, default=10, help="timed decode steps per row (default: 10)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--bw-bytes", type=int, default=2 * 1024**3,
                   help="bytes the bandwidth probe sums (default: 2 GiB)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.lab.moe_step", description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=",".join(MODELS), help=f"of {', '.join(MODELS)} (default: all)")
    add_step_arguments(p)
    shape = p.add_argument_group("model shape (bench/lab/moe_models.py; each new shape is built once)")
    for f in fields(Shape):
        shape.add_argument("--" + f.name.replace("_", "-"), type=int, default=f.default,
                           help=f"{SHAPE_HELP[f.name]} (default: %(default)s)")
    p.add_argument("--doc", type=Path, default=ROOT / "docs" / "benchmarks.md", help="the file to update")
    p.add_argument("--no-doc", action="store_true", help="print the section, leave --doc alone")
    p.add_argument("--json", type=Path, default=None, help="also write every step's figures here")
    return p


def parse(argv: list[str] | None) -> tuple[argparse.Namespace, Shape]:
    p = build_parser()
    args = p.parse_args(argv)
    args.models = args.models.split(",")
    for name in args.models:
        if name not in MODELS:
            p.error(f"--models: unknown model {name!r}; choose from {', '.join(MODELS)}")
    args.batches = positive_list(args.batches, "--batches", p)
    shape = Shape(**{f.name: getattr(args, f.name) for f in fields(Shape)})
    for f in fields(Shape):
        if getattr(shape, f.name) < (0 if f.name == "dense_intermediate" else 1):
            p.error(f"--{f.name.replace('_', '-')} must be positive")
    if shape.top_k > shape.experts:
        p.error(f"--top-k ({shape.top_k}) must not exceed --experts ({shape.experts})")
    if shape.heads % shape.kv_heads:
        p.error(f"--heads ({shape.heads}) must be a multiple of --kv-heads ({shape.kv_heads})")
    counts = {"--context": args.context, "--repeats": args.repeats, "--bw-bytes": args.bw_bytes}
    for flag, value in counts.items():
        if value < 1:
            p.error(f"{flag} must be >= 1")
    return args, shape


def engine_for(folder: Path, args: argparse.Namespace, kv_token: int, dtype: str = "float32") -> LLMEngine:
    """An engine (float32; ``auto`` for a quantized checkpoint, whose codes it keeps) with room for the
    largest batch's KV (``kv_token`` bytes a token) and no more."""
    block = EngineConfig().block_size
    tokens = args.context + WARM_STEPS + args.repeats + 1
    kv = max(args.batches) * (-(-tokens // block) + 1) * block * kv_token
    return LLMEngine(str(folder), EngineConfig(
        dtype=dtype, enable_prefix_caching=False, max_num_seqs=max(args.batches), kv_cache_memory=kv,
        max_num_batched_tokens=max(2048, max(args.batches)), num_threads=args.threads))


def main(argv: list[str] | None = None) -> int:
    args, shape = parse(argv)
    command = "python -m bench.lab.moe_step " + shlex.join(argv if argv is not None else sys.argv[1:])
    started = machine()
    rows: list[Row] = []
    infos: dict[str, ModelInfo] = {}
    for name in args.models:
        folder = model_dir(name, shape)
        engine = engine_for(folder, args, 2 * shape.layers * shape.kv_heads * shape.head_dim * 4,
                            "auto" if name in QUANTIZED else "float32")
        count = parameter_count(engine.model_config)
        model = engine.runner.model
        infos[name] = ModelInfo(name, count.total, count.active, model.execution_path, held_total(engine))
        for batch in args.batches:
            rows.append(run_row(engine, name, batch, args.context, args.repeats, args.bw_bytes))
            print(table(rows[-1:])[-1], flush=True)
        del engine
        gc.collect()
    section = render(rows, infos, shape, args.context, args.repeats, args.bw_bytes, started, command.strip())
    publish(section, args.doc, not args.no_doc, BEGIN, END)
    if args.json:
        figures = {"shape": asdict(shape), "models": [asdict(i) for i in infos.values()],
                   "rows": [asdict(r) for r in rows]}
        args.json.write_text(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

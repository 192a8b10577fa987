"""One layer's latent attention for decode rows: the native kernel against the torch reference and the
read floor of the latent it attends over.

DeepSeek's widths (a latent of 512 + 64 rotary values per token, ``w_uk``/``w_uv`` of 128 per head) and
16 query heads: DeepSeek-V2-Lite's count, and a rank's share of V3's 128 at tensor parallelism 8. Each
request has ``--context`` cached tokens in a paged cache of 16-token blocks in shuffled order; a step is
``batch`` decode rows through ``MlaTorchBackend.forward`` (the reference: rows gathered, then einsums)
and ``MlaNativeBackend.forward`` (``kernels/cpu_mla.c``: rows read in place, once for all heads),
which differ only in the absorbed form's attention; the row write, the query absorption and the value
projection are the same code in both. Candidates run interleaved step by step, after warm-up; the
table gives the median of ``--repeats`` steps. Floor: the latent bytes the rows attend over
(batch x context x 576 x element size) / the read bandwidth of a torch ``sum``; the attention is
compute-bound on CPU (2 x heads x (576 + 512) flops a cached token), so the table gives the native
kernel's GFLOP/s too.

The section between ``<!-- bench-mla-attention:begin -->`` and ``<!-- bench-mla-attention:end -->``
of ``--doc`` is rewritten with the host, the command and the date.

    python -m bench.lab.mla_attention [--batches 1,16] [--contexts 512,4096] [--dtypes float32,bfloat16]
        [--repeats 20] [--threads N] [--doc PATH | --no-doc]
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.lab.moe_step import positive_list
from bench.lab.step_profile import read_bandwidth
from bench.sections import machine, opening, publish
from kernels.attention import AttentionMetadata
from kernels.mla import MlaTorchBackend
from kernels.mla_backends import MlaNativeBackend

BEGIN, END = "<!-- bench-mla-attention:begin -->", "<!-- bench-mla-attention:end -->"
ROOT = Path(__file__).resolve().parents[2]
HEADS, NOPE, ROPE, V, RANK, BLOCK = 16, 128, 64, 128, 512, 16
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
WARM = 3
BW_BYTES = 1 << 30


@dataclass
class Row:
    batch: int
    context: int
    dtype: str
    torch_ms: float
    native_ms: float
    floor_ms: float


def _step(batch: int, context: int, dtype: torch.dtype) -> tuple[AttentionMetadata, dict[str, torch.Tensor]]:
    """A decode step of ``batch`` rows over ``context`` cached tokens each, and its tensors."""
    g = torch.Generator().manual_seed(0)
    per_seq = -(-(context + 1) // BLOCK)
    order = torch.randperm(batch * per_seq, generator=g).tolist()
    tables = [order[s * per_seq:(s + 1) * per_seq] for s in range(batch)]
    meta = AttentionMetadata.build(BLOCK, [1] * batch, [context + 1] * batch, tables)
    cache = (torch.randn(batch * per_seq, 1, BLOCK, 1, RANK + ROPE, generator=g) * 0.5).to(dtype)
    tensors = {"cache": cache, "q_nope": torch.randn(batch, HEADS, NOPE, generator=g),
               "q_rope": torch.randn(batch, HEADS, ROPE, generator=g),
               "latent": torch.randn(batch, RANK + ROPE, generator=g),
               "w_uk": torch.randn(HEADS, NOPE, RANK, generator=g) / RANK**0.5,
               "w_uv": torch.randn(HEADS, V, RANK, generator=g) / RANK**0.5}
    return meta, tensors


def _forward(backend: MlaTorchBackend, t: dict[str, torch.Tensor]) -> float:
    start = time.perf_counter()
    backend.forward(t["q_nope"], t["q_rope"], t["latent"], t["cache"], t["w_uk"], t["w_uv"],
                    (NOPE + ROPE) ** -0.5)
    return time.perf_counter() - start


def run_row(batch: int, context: int, dtype: str, repeats: int, bandwidth: float) -> Row:
    meta, tensors = _step(batch, context, DTYPES[dtype])
    backends = {"torch": MlaTorchBackend(), "native": MlaNativeBackend()}
    times: dict[str, list[float]] = {name: [] for name in backends}
    for b in backends.values():
        b.prepare(meta)
    for i in range(WARM + repeats):
        for name, b in backends.items():
            elapsed = _forward(b, tensors)
            if i >= WARM:
                times[name].append(elapsed)
    latent_bytes = batch * context * (RANK + ROPE) * tensors["cache"].element_size()
    return Row(batch, context, dtype, 1e3 * statistics.median(times["torch"]),
               1e3 * statistics.median(times["native"]), 1e3 * latent_bytes / bandwidth)


def table(rows: list[Row]) -> list[str]:
    out = ["| batch | context | cache | torch reference ms | native ms | speed-up | read floor ms "
           "| native GFLOP/s |", "|---:|---:|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        gflops = 2 * r.batch * (r.context + 1) * HEADS * (2 * RANK + ROPE) / r.native_ms / 1e6
        out.append(f"| {r.batch} | {r.context} | {r.dtype} | {r.torch_ms:.2f} | {r.native_ms:.2f} | "
                   f"**{r.torch_ms / r.native_ms:.1f}x** | {r.floor_ms:.2f} | {gflops:.0f} |")
    return out


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.lab.mla_attention",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", default="1,16", help="decode rows per step, comma-separated (default: 1,16)")
    p.add_argument("--contexts", default="512,4096", help="cached tokens per row (default: 512,4096)")
    p.add_argument("--dtypes", default="float32,bfloat16", help="latent cache dtypes (default: both)")
    p.add_argument("--repeats", type=int, default=20, help="timed steps per candidate (default: 20)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's own)")
    p.add_argument("--doc", type=Path, default=ROOT / "docs" / "benchmarks.md", help="the file to update")
    p.add_argument("--no-doc", action="store_true", help="print the section, leave --doc alone")
    args = p.parse_args(argv)
    args.batches = positive_list(args.batches, "--batches", p)
    args.contexts = positive_list(args.contexts, "--contexts", p)
    args.dtypes = args.dtypes.split(",")
    unknown = [d for d in args.dtypes if d not in DTYPES]
    if unknown:
        p.error(f"--dtypes must name {' or '.join(DTYPES)}, got {', '.join(unknown)}")
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    if args.threads < 0:
        p.error("--threads must be >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    command = "python -m bench.lab.mla_attention " + shlex.join(argv if argv is not None else sys.argv[1:])
    started = machine()
    bandwidth = read_bandwidth(BW_BYTES)
    rows = []
    for dtype in args.dtypes:
        for context in args.contexts:
            for batch in args.batches:
                rows.append(run_row(batch, context, dtype, args.repeats, bandwidth))
                print(table(rows[-1:])[-1], flush=True)
    setting = (f"torch threads: {torch.get_num_threads()}; read bandwidth {bandwidth / 1e9:.1f} GB/s "
               "(a torch `sum`)")
    lines = opening(BEGIN, "Latent attention's decode rows: the native kernel", command.strip(), started,
                    setting, args.repeats, "the kernel's speed")
    lines += ["One layer's latent attention for decode rows (`bench/lab/mla_attention.py`): DeepSeek's "
              f"latent (512 + 64) and {HEADS} heads (V2-Lite's; V3's 128 over 8 ranks), one forward of "
              "`MlaTorchBackend` (rows gathered, then einsums) against `MlaNativeBackend` "
              "(`kernels/cpu_mla.c`, rows read in place once for all heads), interleaved, median of "
              f"{args.repeats} after {WARM} warm-up. The read floor is the latent bytes attended over / the "
              "read bandwidth; the attention is compute-bound here, not read-bound: every cached token costs "
              f"2 x {HEADS} x (576 + 512) flops for 576 values read (the GFLOP/s column counts those flops "
              "over the native forward's whole time, the query absorption and value projection included).",
              "", *table(rows), "", END]
    publish("\n".join(lines), args.doc, not args.no_doc, BEGIN, END)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""pdserve against vLLM's CPU build: the same weights, the same client, one sitting.

    python -m bench.compare_vllm [--duration 60] [--concurrency 1 4 16] [--doc docs/benchmarks.md]

Three servers, one after another, each driven by ``pdserve bench``'s client (``bench.comparer``) with
``random`` 256 -> 64 tokens (greedy, ``ignore_eos``) at each concurrency, after one
untimed warm-up request:

- ``pdserve serve`` as it starts by default (1 prefill + 1 decode worker, one
  torch thread each);
- pdserve colocated: one worker using both cores (``--num-prefill 0
  --num-decode 1 --worker-cpus 2``, so two torch threads);
- vLLM's CPU build (``scripts/vllm_cpu.sh serve``; run ``bash
  scripts/vllm_cpu.sh install`` first) on the Hugging Face folder that
  ``bench.export_hf`` writes from the same GGUF.

The table (output tok/s, ratios, ITL and TTFT p50) replaces what lies between
the ``<!-- bench-vllm:begin -->`` and ``<!-- bench-vllm:end -->`` markers of
``--doc``; raw summaries go to ``--out``. ``python -m bench.compare --vllm``
runs the same after its own scenarios.
"""

from __future__ import annotations

import argparse
import contextlib
import shlex
import signal
import sys
from pathlib import Path

from bench.comparer import Comparer, Run, ms
from bench.sections import machine, replace_section
from bench.servers import ROOT, free_port, server
from bench.tokenizer import load_tokenizer
from bench.workloads import WordSource

BEGIN, END = "<!-- bench-vllm:begin -->", "<!-- bench-vllm:end -->"
RANDOM_VLLM: dict[str, float] = {"input_len": 256, "output_len": 64}
SYSTEMS: dict[str, tuple[str, ...]] = {
    "disagg": (),
    "colocated": ("--num-prefill", "0", "--num-decode", "1", "--worker-cpus", "2"),
}


def vllm_server(out: Path, log: Path) -> contextlib.AbstractContextManager[str]:
    """vLLM's CPU build (``scripts/vllm_cpu.sh serve``) on the Hugging Face folder ``bench.export_hf``
    writes from the built-in GGUF (into ``out``, once), until the block ends; yields its URL."""
    hf = out / "smollm2-hf"
    if not (hf / "config.json").is_file():
        from bench.export_hf import export_hf

        export_hf(None, hf)
    port = free_port()
    cmd = ["bash", str(ROOT / "scripts" / "vllm_cpu.sh"), "serve", str(hf), str(port)]
    return server(cmd, f"http://127.0.0.1:{port}", log, ready_timeout=900)


def run_all(c: Comparer, concurrency: list[int]) -> None:
    """Every system at every concurrency, one server at a time."""
    for tag, flags in SYSTEMS.items():
        with c.pdserve(f"vllm_{tag}", *flags) as url:
            for conc in concurrency:
                c.bench(url, f"{tag}_random_c{conc}", "random", RANDOM_VLLM, f"c{conc}")
    with vllm_server(c.args.out, c.args.out / "vllm.log") as url:
        for conc in concurrency:
            c.bench(url, f"vllm_random_c{conc}", "random", RANDOM_VLLM, f"c{conc}")


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b else "-"


def render(runs: dict[str, Run], concurrency: list[int], started: str, command: str, duration: float) -> str:
    lines = [BEGIN, "", "## Against vLLM's CPU build: one pass", "",
             f"Regenerate with `{command}`. Machine: {started}. Workload: `random` "
             f"{RANDOM_VLLM['input_len']:g} -> {RANDOM_VLLM['output_len']:g} tokens, float32, "
             f"{duration:g} s of load per run, the same client (`pdserve bench`'s); "
             "vLLM `vllm-cpu` 0.32.0 from "
             "`scripts/vllm_cpu.sh serve` on the folder written by `python -m bench.export_hf` (the same "
             "weights). pdserve: `pdserve serve` (default: 1 prefill + 1 decode, one torch thread each) and "
             "colocated `pdserve serve --num-prefill 0 --num-decode 1 --worker-cpus 2` (one worker, two "
             "torch threads). Each server gets one untimed warm-up request first. Both systems' "
             "processes start with torch's huge pages on (`THP_MEM_ALLOC_ENABLE=1`: pdserve's workers "
             "always, vLLM's server from this command's environment, `bench/__init__.py`).", "",
             "| concurrency | system | ok/sent | output tok/s | / vLLM | ITL p50 (ms) | TTFT p50 (ms) |",
             "|---:|---|---:|---:|---:|---:|---:|"]
    for conc in concurrency:
        theirs = runs.get(f"vllm_random_c{conc}")
        base = theirs.summary["output_throughput"] if theirs else 0.0
        for tag, label in (("disagg", "pdserve, 1P+1D"), ("colocated", "pdserve, colocated"),
                           ("vllm", "vLLM")):
            run = runs.get(f"{tag}_random_c{conc}")
            if run is None:
                continue
            s = run.summary
            lines.append(f"| {conc} | {label} | {s['completed']}/{s['requests']} | "
                         f"{s['output_throughput']:.1f} | {_ratio(s['output_throughput'], base)} | "
                         f"{ms(run, 'itl')} | {ms(run, 'ttft')} |")
    lines += ["", END]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.compare_vllm", description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=60.0, help="seconds of load per run (default: 60)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16], metavar="C")
    p.add_argument("--doc", type=Path, default=ROOT / "docs" / "benchmarks.md", help="the file to update")
    p.add_argument("--out", type=Path, default=ROOT / "bench_out" / "compare_vllm", help="raw results folder")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    args = p.parse_args(argv)
    if not args.duration > 0:
        p.error("--duration must be > 0")
    if any(c < 1 for c in args.concurrency):
        p.error("--concurrency values must be >= 1")
    args.out.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    command = "python -m bench.compare_vllm " + shlex.join(
        [x for x in (argv if argv is not None else sys.argv[1:]) if x != "--quiet"])
    started = machine()
    comparer = Comparer(args, WordSource(load_tokenizer(None)))
    run_all(comparer, args.concurrency)
    block = render(comparer.runs, args.concurrency, started, command.strip(), args.duration)
    replace_section(args.doc, block, BEGIN, END)
    print(f"updated {args.doc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

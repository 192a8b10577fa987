"""Two or more server set-ups (``pdserve serve``, vLLM) under the same load, alternated round by round.

    python -m bench.alternate [--rounds 4] [--duration 60] [--concurrency 16 ...] [--warmup 10]
        [--system NAME='FLAGS' ...] [--vllm] [--json OUT]

On a host whose speed swings by 15-20% from one minute to the next, one run of
each set-up says little about their ratio. Here every round starts each set-up's
server in turn (the order reversed every other round, so neither always runs
first), drives it with ``pdserve bench``'s client (``random`` 256 -> 64 tokens,
greedy, ``ignore_eos``) at each ``--concurrency``, ``--warmup`` seconds
unmeasured and then ``--duration`` seconds measured, and stops it. The report
gives every run (with the load average at its start), each set-up's median
output tok/s, and each round's ratio to the first set-up, so a ratio is taken
between runs minutes apart, not between sittings.

The default set-ups are ``bench.compare_vllm``'s: ``disagg`` (``pdserve serve``
as it starts by default) and ``colocated`` (``--num-prefill 0 --num-decode 1
--worker-cpus 2``). A set-up's words before its first flag that read ``VAR=value``
set the server's environment (``--system mkl='PDSERVE_LARGE_PRODUCT=mkl'``).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import shlex
import statistics
import sys
from pathlib import Path
from typing import Any

from bench.compare_vllm import RANDOM_VLLM, SYSTEMS, vllm_server
from bench.comparer import Comparer
from bench.sections import machine
from bench.servers import ROOT, free_port, pdserve_cmd, server
from bench.tokenizer import load_tokenizer
from bench.workloads import WordSource


def parse_system(text: str) -> tuple[str, tuple[str, ...]]:
    name, sep, flags = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"--system takes NAME='FLAGS', got {text!r}")
    return name, tuple(shlex.split(flags))


VLLM = "vllm"


def split_env(words: tuple[str, ...]) -> tuple[list[str], list[str]]:
    """A set-up's leading ``VAR=value`` words (its environment) and the flags after them."""
    env = list(itertools.takewhile(lambda w: "=" in w and not w.startswith("-"), words))
    return env, list(words[len(env):])


def _serve(c: Comparer, tag: str, words: tuple[str, ...] | None) -> contextlib.AbstractContextManager[str]:
    """``pdserve serve`` with ``words``: leading ``VAR=value`` words set its environment, the rest are
    its flags; ``None``: vLLM's CPU build (``scripts/vllm_cpu.sh serve``) on the same weights."""
    log = c.args.out / f"{tag}.log"
    if words is None:
        return vllm_server(c.args.out, log)
    env, flags = split_env(words)
    port = free_port()
    cmd = pdserve_cmd(port, *flags)
    return server(["env", *env, *cmd] if env else cmd, f"http://127.0.0.1:{port}", log)


def _describe(words: tuple[str, ...] | None) -> str:
    return "scripts/vllm_cpu.sh serve" if words is None else shlex.join(words) or "(defaults)"


def run_rounds(c: Comparer, systems: dict[str, tuple[str, ...] | None], rounds: int, loads: list[int],
               warmup: float) -> list[dict[str, Any]]:
    """One row per run: round, set-up, concurrency, load average at its start, and its figures."""
    rows: list[dict[str, Any]] = []
    order = list(systems)
    for r in range(rounds):
        for name in order if r % 2 == 0 else order[::-1]:
            with _serve(c, f"{name}_r{r}", systems[name]) as url:
                for conc in loads:
                    tag = f"{name}_c{conc}_r{r}"
                    if warmup > 0:
                        c.bench(url, f"{tag}_warmup", "random", RANDOM_VLLM, f"c{conc}", warmup)
                    loadavg = os.getloadavg()[0]
                    s = c.bench(url, tag, "random", RANDOM_VLLM, f"c{conc}").summary
                    rows.append({"round": r, "system": name, "concurrency": conc, "loadavg": loadavg,
                                 "output_tok_s": s["output_throughput"], "ok": s["completed"],
                                 "sent": s["requests"], "itl_p50_ms": s["itl"]["p50_ms"],
                                 "ttft_p50_ms": s["ttft"]["p50_ms"]})
                    print(f"alternate: round {r} {name} c{conc}: {rows[-1]['output_tok_s']:.1f} tok/s",
                          file=sys.stderr)
    return rows


def render(rows: list[dict[str, Any]], systems: list[str], header: str) -> str:
    first = systems[0]
    lines = [header, "", "| concurrency | round | set-up | load avg | ok/sent | output tok/s | / " + first
             + " | ITL p50 (ms) | TTFT p50 (ms) |", "|---:|---:|---|---:|---:|---:|---:|---:|---:|"]
    base = {(row["concurrency"], row["round"]): row["output_tok_s"] for row in rows if row["system"] == first}
    for row in sorted(rows, key=lambda x: x["concurrency"]):
        b = base.get((row["concurrency"], row["round"]))
        ratio = row["output_tok_s"] / b if b else float("nan")
        lines.append(f"| {row['concurrency']} | {row['round']} | {row['system']} | {row['loadavg']:.2f} | "
                     f"{row['ok']}/{row['sent']} | {row['output_tok_s']:.1f} | {ratio:.3f} | "
                     f"{row['itl_p50_ms']:.0f} | {row['ttft_p50_ms']:.0f} |")
    lines.append("")
    for conc in sorted({row["concurrency"] for row in rows}):
        for name in systems:
            mine = [row for row in rows if row["system"] == name and row["concurrency"] == conc]
            tok = [row["output_tok_s"] for row in mine]
            ratios = [row["output_tok_s"] / base[(conc, row["round"])] for row in mine
                      if base.get((conc, row["round"]))]
            lines.append(f"- concurrency {conc}, {name}: median {statistics.median(tok):.1f} tok/s (min "
                         f"{min(tok):.1f}, max {max(tok):.1f}); median ratio to {first} "
                         f"{statistics.median(ratios):.3f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.alternate", description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=4, help="rounds of every set-up (default: 4)")
    p.add_argument("--duration", type=float, default=60.0, help="measured seconds per run (default: 60)")
    p.add_argument("--warmup", type=float, default=10.0,
                   help="unmeasured seconds of the same load before each run (default: 10; 0: none)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[16], metavar="C",
                   help="clients; each value runs on every server started (default: 16)")
    p.add_argument("--system", type=parse_system, action="append", metavar="NAME='FLAGS'",
                   help="a set-up: its name and its `pdserve serve` flags, after any VAR=value words for "
                        "its environment; repeat for each (default: "
                        "disagg='' and colocated='--num-prefill 0 --num-decode 1 --worker-cpus 2'); "
                        "ratios are to the first")
    p.add_argument("--vllm", action="store_true",
                   help="vLLM's CPU build as one more set-up, named vllm (`bash scripts/vllm_cpu.sh install` "
                        "first; served on the folder `bench.export_hf` writes from the same GGUF)")
    p.add_argument("--out", type=Path, default=ROOT / "bench_out" / "alternate", help="raw results folder")
    p.add_argument("--json", type=Path, help="write the rows as JSON here too")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    args = p.parse_args(argv)
    if args.rounds < 1 or min(args.concurrency) < 1 or not args.duration > 0 or args.warmup < 0:
        p.error("--rounds and --concurrency must be >= 1, --duration > 0 and --warmup >= 0")
    systems: dict[str, tuple[str, ...] | None] = dict(args.system) if args.system else dict(SYSTEMS)
    if args.vllm:
        if VLLM in systems:
            p.error(f"--vllm adds a set-up named {VLLM}: give --system another name")
        systems[VLLM] = None
    if len(systems) < 2:
        p.error("give at least two set-ups with different names (--system, --vllm)")
    args.out.mkdir(parents=True, exist_ok=True)
    command = "python -m bench.alternate " + shlex.join(
        [x for x in (argv if argv is not None else sys.argv[1:]) if x != "--quiet"])
    header = (f"`{command.strip()}`; {machine()}; `random` {RANDOM_VLLM['input_len']:g} -> "
              f"{RANDOM_VLLM['output_len']:g} at concurrency {', '.join(map(str, args.concurrency))}, "
              f"{args.duration:g} s measured after {args.warmup:g} s of warm-up; set-ups: "
              + "; ".join(f"{n} `{_describe(f)}`" for n, f in systems.items()))
    rows = run_rounds(Comparer(args, WordSource(load_tokenizer(None))), systems, args.rounds,
                      args.concurrency, args.warmup)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    print(render(rows, list(systems), header))
    return 0


if __name__ == "__main__":
    sys.exit(main())

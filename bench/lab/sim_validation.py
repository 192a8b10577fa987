"""The simulator against real runs (``scripts/validate_simulator.sh``): a bench run's requests as a
simulator trace, and the table of simulated against measured figures.

- ``trace RUN_DIR TRACE_CSV [--prefix-len N]``: ``RUN_DIR/requests.csv`` (``pdserve bench``'s record of
  an open-loop run) as ``pdserve simulate --trace`` input: each request's send time, its measured prompt
  and output tokens, and its prefix (``shared-prefix``'s ``prefix<k>`` labels share the first
  ``--prefix-len`` tokens, as ``planner/workload.py`` models them; other labels share nothing). Failed
  requests are kept: the server was sent them.
- ``table OUT CONFIGS WORKLOADS``: the markdown table of every ``OUT/<P>p<D>d_<workload>[_open]`` run
  against its ``.sim.json`` (own core each) and ``.sim_host.json`` (sharing the host). Throughput on
  both sides is completed requests over the time from the first send to the last answer (the
  simulator's definition; ``requests.csv`` gives it for the run: the bench's own summary counts to its
  deadline, which in an open loop that went idle before it is longer).
- ``steps OUT PROFILE``: what the workers' steps did in each run (``/v1/workers`` after minus before):
  per role, steps, the decode steps' mean batch, wall over the profile's price of the same steps, wall
  over CPU (the wait for a core) and CPU over the price (contention).
"""

from __future__ import annotations

import argparse
import csv
import json
import re
from pathlib import Path

from planner.workload import SHARED_PREFIX_BASE  # the simulator's id of shared-prefix's first prefix

MODES = (("closed", ""), ("open", "_open"))


def requests_to_trace(run_dir: Path, trace: Path, prefix_len: int = 0) -> int:
    """Write ``run_dir/requests.csv`` as a simulator trace at ``trace``; the number of requests."""
    with (run_dir / "requests.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    with trace.open("w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["arrival_s", "input_tokens", "output_tokens", "prefix_id", "prefix_tokens"])
        for row in rows:
            match = re.fullmatch(r"prefix(\d+)", row["label"])
            pid, ptok = (SHARED_PREFIX_BASE + int(match[1]), prefix_len) if match and prefix_len else (-1, "")
            n_in = int(row["prompt_tokens"] or 0)
            n_out = int(row["output_tokens"] or 0)
            if n_in < 1:
                raise ValueError(f"{run_dir}/requests.csv: a request without its prompt tokens: {row}")
            out.writerow([row["start_s"], n_in, max(n_out, 1), pid, ptok])
    return len(rows)


def run_throughput(run_dir: Path) -> float:
    """Completed requests over first send to last answer, from ``run_dir/requests.csv``."""
    with (run_dir / "requests.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    ok = [r for r in rows if r["status"] == "ok"]
    if not ok:
        return 0.0
    first = min(float(r["start_s"]) for r in rows)
    last = max(float(r["start_s"]) + float(r["e2e_s"]) for r in ok)
    return len(ok) / max(last - first, 1e-9)


def steps_table(out: Path, profile: Path) -> str:
    from planner.calibrate import role_clocks
    from planner.profile import load_profile

    prof = load_profile(profile)
    lines = ["| run | decode: steps, mean batch, wall / priced, wall / CPU, CPU / priced "
             "| prefill: steps, wall / priced, wall / CPU, CPU / priced |", "|---|---|---|"]
    for before in sorted(out.glob("*.workers_before.json")):
        after = before.with_name(before.name.replace("before", "after"))
        if not after.exists():
            continue
        old, new = (json.loads(p.read_text())["workers"] for p in (before, after))
        d, p = role_clocks(old, new, "decode"), role_clocks(old, new, "prefill")
        ds, ps = d.decode_stretch(prof.decode), p.prefill_stretch(prof.prefill)
        batch = d.decode_rows / max(d.decode_steps, 1)
        lines.append(f"| {before.name.split('.')[0]} | {d.decode_steps:,}, {batch:.2f}, {ds:.2f}, "
                     f"{d.cpu_stretch:.2f}, {ds / d.cpu_stretch:.2f} | {p.prefill_steps}, {ps:.2f}, "
                     f"{p.cpu_stretch:.2f}, {ps / p.cpu_stretch:.2f} |")
    return "\n".join(lines)


def _err(sim: float, real: float) -> str:
    return f"{(sim - real) / real:+.0%}" if real else "n/a"


def table(out: Path, configs: list[str], workloads: list[str]) -> str:
    lines = ["| P:D | workload | load | simulated as | TTFT p50 sim / real (ms) | err "
             "| TTFT p90 sim / real (ms) | err | ITL p50 sim / real (ms) "
             "| throughput sim / real (req/s) | err |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in configs:
        p, d = c.split(":")
        for w in workloads:
            name = w.split(":")[0]
            for mode, suffix in MODES:
                base = out / f"{p}p{d}d_{name}{suffix}"
                if not (base / "summary.json").exists():
                    continue
                real = json.loads((base / "summary.json").read_text())
                r50, r90 = real["ttft"]["p50_ms"], real["ttft"]["p90_ms"]
                ri50, rthr = real["itl"]["p50_ms"], run_throughput(base)
                for label, kind in (("own core each", "sim"), ("sharing the host (calibrated)", "sim_host")):
                    path = Path(f"{base}.{kind}.json")
                    if not path.exists():
                        continue
                    sim = json.loads(path.read_text())["result"]
                    t50, t90 = sim["ttft"]["p50"] * 1000, sim["ttft"]["p90"] * 1000
                    i50, thr = sim["itl"]["p50"] * 1000, sim["request_throughput"]
                    lines.append(f"| {p}P:{d}D | {name} | {mode} | {label} | {t50:,.0f} / {r50:,.0f} | "
                                 f"{_err(t50, r50)} | {t90:,.0f} / {r90:,.0f} | {_err(t90, r90)} | "
                                 f"{i50:.0f} / {ri50:.0f} | {thr:.3f} / {rthr:.3f} | {_err(thr, rthr)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.lab.sim_validation", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    t = sub.add_parser("trace", help="a bench run's requests.csv as a simulator trace")
    t.add_argument("run_dir", type=Path)
    t.add_argument("trace", type=Path)
    t.add_argument("--prefix-len", type=int, default=0, metavar="N",
                   help="tokens a shared-prefix request shares with its prefix<k> group (default: 0, none)")
    tb = sub.add_parser("table", help="the markdown table of simulated against measured")
    tb.add_argument("out", type=Path)
    tb.add_argument("configs", help='P:D list, e.g. "1:1 1:2"')
    tb.add_argument("workloads", help='workload:params list, as scripts/validate_simulator.sh takes it')
    st = sub.add_parser("steps", help="what the workers' steps did in each run, priced with a profile")
    st.add_argument("out", type=Path)
    st.add_argument("profile", type=Path)
    args = parser.parse_args(argv)
    if args.command == "trace":
        requests_to_trace(args.run_dir, args.trace, args.prefix_len)
    elif args.command == "steps":
        print(steps_table(args.out, args.profile))
    else:
        print(table(args.out, args.configs.split(), args.workloads.split()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

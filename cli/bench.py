"""``pdserve bench``: load an OpenAI-compatible server; report latency, throughput and goodput.

    pdserve bench --url URL --workload NAME (--rate R | --concurrency C) --duration S --output DIR
    pdserve bench sweep --url URL --workload NAME --slo ttft=2s,itl=200ms --output DIR

``bench`` (or ``bench run``) writes ``summary.json``, ``requests.csv``, ``metrics.csv``,
``latency_cdf.png`` and, when the server exposes metrics, ``timeline.png`` into DIR and
prints the summary. ``bench sweep`` runs the workload at rising rates (``--start-rate``,
times ``--factor`` each step) until SLO attainment falls below ``--target``, then bisects
between the last rate that met it and the first that did not (``--refine`` steps); each
step goes to DIR/rate_R/, and ``sweep.json``, ``sweep.csv`` and ``sweep.png`` give the
maximum goodput (requests/s meeting the SLO, at a rate whose attainment met the target).
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import functools
import sys
import time
from pathlib import Path
from typing import Any

from bench.stats import SLO, parse_slo, summarize
from bench.tokenizer import load_tokenizer
from bench.workloads import WORKLOADS, WordSource, Workload, describe, make_workload, parse_params
from cli.argtypes import RawDescriptionDefaultsHelpFormatter, number, positive

_positive_float = positive(float)
_positive_int = number(int, lambda v: v >= 1, ">= 1")


def add_bench_parser(sub: Any) -> None:
    """Register ``bench`` on the ``pdserve`` subparsers; sets ``handler`` to :func:`run_bench_command`."""
    p = sub.add_parser(
        "bench", help="load an OpenAI-compatible server with a workload and report latency and goodput",
        description=__doc__.split("\n\n", 2)[2].replace("``", "`") if __doc__ else None,
        formatter_class=RawDescriptionDefaultsHelpFormatter)
    p.add_argument("mode", nargs="?", choices=("run", "sweep"), default="run",
                   help="run: one load at --rate or --concurrency (default); sweep: raise the rate until "
                        "SLO attainment drops below --target")
    p.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--workload", choices=WORKLOADS, default="random", help="workload")
    p.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                   help="workload parameter, repeatable or comma-separated (e.g. input_len=128,"
                        "output_len=32); "
                        "long-context's context_len defaults to the server's max_model_len when it lists one")
    load = p.add_mutually_exclusive_group()
    load.add_argument("--rate", type=_positive_float, default=None, metavar="R",
                      help="open loop: sessions start at Poisson arrivals, R per second")
    load.add_argument("--concurrency", type=_positive_int, default=None, metavar="C",
                      help="closed loop: C sessions in flight at all times")
    p.add_argument("--duration", type=_positive_float, default=60.0, metavar="S",
                   help="seconds of sending new requests; running ones then finish")
    p.add_argument("--output", type=Path, default=Path("bench_out"), metavar="DIR",
                   help="folder for the JSON, CSV and PNG files")
    p.add_argument("--slo", type=str, default=None, metavar="SPEC",
                   help="SLO for goodput: ttft=..., itl=... (mean per request), e2e=...; ms or s, a bare "
                        "number is ms (e.g. ttft=2s,itl=200ms)")
    p.add_argument("--api-key", default=None, metavar="KEY", help="send 'Authorization: Bearer KEY'")
    p.add_argument("--model", default=None, metavar="NAME",
                   help="model name to request (default: the first of GET /v1/models)")
    p.add_argument("--tokenizer", default=None, metavar="PATH",
                   help="model folder or .gguf whose tokenizer counts tokens (default: the built-in model)")
    p.add_argument("--seed", type=int, default=0, help="seed of the workload and arrivals")
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="let requests stop at end-of-sequence (default: send ignore_eos so outputs have "
                        "the workload's lengths)")
    p.add_argument("--request-timeout", type=_positive_float, default=600.0, metavar="S",
                   help="per-request timeout in seconds")
    p.add_argument("--drain-timeout", type=_positive_float, default=60.0, metavar="S",
                   help="after --duration, wait this long for running requests, then cancel them")
    p.add_argument("--metrics-interval", type=_positive_float, default=1.0, metavar="S",
                   help="seconds between reads of the server's /metrics")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar on stderr")
    s = p.add_argument_group("sweep")
    s.add_argument("--start-rate", type=_positive_float, default=0.25, metavar="R",
                   help="first rate of a sweep")
    s.add_argument("--factor", type=_positive_float, default=2.0, metavar="F",
                   help="rate multiplier per sweep step")
    s.add_argument("--max-steps", type=_positive_int, default=8, metavar="N",
                   help="most rising steps of a sweep")
    s.add_argument("--refine", type=int, default=1, metavar="N",
                   help="bisection steps between the last good and first bad rate")
    s.add_argument("--target", type=_positive_float, default=0.9, metavar="FRACTION",
                   help="SLO attainment a sweep rate must reach")
    p.set_defaults(handler=run_bench_command)


@functools.cache
def word_source(path: str | None) -> WordSource:
    return WordSource(load_tokenizer(path))


async def _model_card(url: str, api_key: str | None) -> dict[str, Any]:
    import httpx

    from bench.client import first_model

    async with httpx.AsyncClient(timeout=30) as client:
        return await first_model(client, url, api_key)


def build_workload(name: str, params: dict[str, float], card: dict[str, Any]) -> Workload:
    if name == "long-context" and "context_len" not in params and isinstance(card.get("max_model_len"), int):
        params = {**params, "context_len": float(card["max_model_len"])}
    return make_workload(name, params)


def one_run(args: argparse.Namespace, workload: Workload, words: WordSource, model: str, out_dir: Path,
            slo: SLO | None, rate: float | None, concurrency: int | None) -> dict[str, Any]:
    """Run the load once, write its files into ``out_dir``, return the summary."""
    from bench.client import BenchConfig, run_bench
    from bench.report import metrics_summary, write_run

    cfg = BenchConfig(url=args.url.rstrip("/"), model=model, duration=args.duration, rate=rate,
                      concurrency=concurrency, api_key=args.api_key, seed=args.seed,
                      ignore_eos=args.ignore_eos,
                      request_timeout=args.request_timeout, drain_timeout=args.drain_timeout,
                      metrics_interval=args.metrics_interval, progress=args.progress)
    t0 = time.perf_counter()
    result = run_bench(cfg, workload.sessions(words, args.seed), words.count)
    summary = summarize(result.records, result.duration, slo)
    summary["config"] = {"url": cfg.url, "model": model, "workload": describe(workload), "rate": rate,
                         "concurrency": concurrency, "duration_s": cfg.duration, "seed": cfg.seed,
                         "ignore_eos": cfg.ignore_eos}
    summary["server_metrics"] = metrics_summary(result.samples)
    load = f"rate {rate}/s" if rate is not None else f"concurrency {concurrency}"
    first = min((r.start for r in result.records), default=t0)
    write_run(out_dir, summary, result.records, result.samples, first, f"{workload.name}, {load}")
    return summary


def print_summary(s: dict[str, Any], out: Any = sys.stdout) -> None:
    c = s["config"]
    load = f"rate {c['rate']}/s" if c["rate"] is not None else f"concurrency {c['concurrency']}"
    print(f"workload {c['workload']['name']}, {load}, {s['duration_s']:.1f} s: "
          f"{s['completed']}/{s['requests']} "
          f"requests ok, errors {s['errors'] or 'none'}", file=out)
    print(f"  throughput {s['request_throughput']:.2f} req/s, {s['output_throughput']:.1f} output tok/s, "
          f"{s['total_token_throughput']:.1f} total tok/s", file=out)
    for key in ("ttft", "itl", "tpot", "e2e"):
        d = s[key]
        print(f"  {key.upper():5s} ms: mean {d['mean_ms']:.1f}  p50 {d['p50_ms']:.1f}  "
              f"p90 {d['p90_ms']:.1f}  "
              f"p99 {d['p99_ms']:.1f}", file=out)
    if "slo" in s:
        print(f"  goodput {s['goodput']:.2f} req/s ({s['good_output_throughput']:.1f} tok/s), "
              f"SLO attainment {s['slo_attainment']:.1%}", file=out)


def sweep(args: argparse.Namespace, workload: Workload, words: WordSource, model: str,
          slo: SLO) -> dict[str, Any]:
    """Rising rates until attainment < target, then bisection; writes sweep.{json,csv,png}."""
    from bench.report import plot_sweep, write_json

    points: list[dict[str, Any]] = []

    def step(rate: float) -> dict[str, Any]:
        print(f"sweep: rate {rate:.3g}/s", file=sys.stderr)
        s = one_run(args, workload, words, model, args.output / f"rate_{rate:.4g}", slo, rate, None)
        point = {"rate": rate, "request_throughput": s["request_throughput"], "goodput": s["goodput"],
                 "output_throughput": s["output_throughput"],
                 "good_output_throughput": s["good_output_throughput"],
                 "slo_attainment": s["slo_attainment"], "ttft_p50_ms": s["ttft"]["p50_ms"],
                 "ttft_p99_ms": s["ttft"]["p99_ms"], "itl_p50_ms": s["itl"]["p50_ms"],
                 "requests": s["requests"], "failed": s["failed"]}
        points.append(point)
        return point

    good_rate, bad_rate = None, None
    rate = args.start_rate
    for _ in range(args.max_steps):
        p = step(rate)
        if p["slo_attainment"] is not None and p["slo_attainment"] >= args.target:
            good_rate = rate
            rate *= args.factor
        else:
            bad_rate = rate
            break
    if good_rate is not None and bad_rate is not None:
        lo, hi = good_rate, bad_rate
        for _ in range(max(0, args.refine)):
            mid = (lo + hi) / 2
            p = step(mid)
            if p["slo_attainment"] >= args.target:
                lo = mid
            else:
                hi = mid
    passing = [p for p in points if p["slo_attainment"] >= args.target]
    best = max(passing, key=lambda p: p["goodput"]) if passing else None
    result = {"workload": describe(workload), "slo": slo.as_dict(), "target": args.target, "points": points,
              "max_goodput": best["goodput"] if best else 0.0,
              "max_goodput_rate": best["rate"] if best else None,
              "max_good_output_throughput": best["good_output_throughput"] if best else 0.0}
    args.output.mkdir(parents=True, exist_ok=True)
    write_json(args.output / "sweep.json", result)
    with (args.output / "sweep.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(points[0]))
        w.writeheader()
        w.writerows(points)
    plot_sweep(args.output / "sweep.png", points, args.target, f"{workload.name}: goodput against rate")
    return result


def run_bench_command(args: argparse.Namespace) -> int:
    """Entry point of ``pdserve bench``; bad flags raise ValueError naming the flag."""
    params = parse_params(args.param)
    slo = parse_slo(args.slo) if args.slo else None
    if args.mode == "sweep":
        if slo is None:
            raise ValueError("--slo is required for a sweep")
        if args.rate is not None or args.concurrency is not None:
            raise ValueError("--rate/--concurrency: a sweep chooses its own rates (use --start-rate)")
    elif args.rate is None and args.concurrency is None:
        raise ValueError("give one of --rate or --concurrency")
    args.url = args.url.rstrip("/")
    try:
        card = asyncio.run(_model_card(args.url, args.api_key))
    except Exception as exc:  # connection refused, bad JSON, 401...
        print(f"pdserve bench: cannot reach {args.url}: {exc}", file=sys.stderr)
        return 1
    model = args.model or str(card.get("id"))
    workload = build_workload(args.workload, params, card)
    words = word_source(args.tokenizer)
    if args.mode == "sweep":
        assert slo is not None
        result = sweep(args, workload, words, model, slo)
        print(f"max goodput {result['max_goodput']:.3f} req/s at rate {result['max_goodput_rate']} "
              f"(SLO attainment >= {args.target:.0%}); files in {args.output}")
        return 0
    summary = one_run(args, workload, words, model, args.output, slo, args.rate, args.concurrency)
    print_summary(summary)
    print(f"files in {args.output}")
    return 0

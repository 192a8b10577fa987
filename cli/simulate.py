"""``pdserve simulate``: a cluster's latency, throughput and goodput, from a profile, without running it.

    pdserve simulate --profile P --workload NAME [--param K=V] (--rate R | --concurrency C)
        [--num-prefill N --num-decode N] [--slo ttft=1s,itl=50ms] [--duration S]
    pdserve simulate --profile P --trace FILE --num-prefill N --num-decode N
    pdserve simulate --profile P --workload NAME --rate R --slo ttft=..,itl=.. --search
        [--min-prefill N --max-prefill N --min-decode N --max-decode N]
    pdserve simulate --profile P --workload NAME --num-prefill N --num-decode N --slo ... --max-rate

A discrete-event simulation (``planner/simulator.py``) of the router, the prefill and decode queues,
continuous batching, prefix-cache hits and KV transfers, driven by the profile's measured costs
(``pdserve profile``). It reports TTFT, ITL and E2E percentiles, throughput, goodput (``--slo``) and
each role's utilisation. ``--search`` finds the fewest workers (then the P:D split) whose TTFT p90
and ITL p90 meet ``--slo`` at ``--rate``; ``--max-rate`` finds the highest rate a P:D meets it at
(both with ``--search``: the found split's highest rate). Workloads are ``pdserve bench``'s, by length,
or a trace CSV of arrival_s,input_tokens,output_tokens,prefix_id[,prefix_tokens].
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

from bench.stats import parse_slo
from bench.workloads import WORKLOADS, parse_params
from cli.argtypes import RawDescriptionDefaultsHelpFormatter, number, positive

_count = number(int, lambda v: v >= 1, ">= 1")


def add_simulate_parser(sub: Any) -> None:
    p = sub.add_parser(
        "simulate", help="simulate a P:D cluster from a profile: latency, throughput, goodput; size one",
        description=__doc__.split("\n\n", 2)[2].replace("``", "`") if __doc__ else None,
        formatter_class=RawDescriptionDefaultsHelpFormatter)
    p.add_argument("--profile", required=True, type=Path, metavar="FILE",
                   help="profile JSON written by `pdserve profile` (or a scaled one)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--workload", choices=WORKLOADS, default=None,
                     help="a `pdserve bench` workload (default: random); multi-turn and copy-heavy are not "
                          "modelled")
    src.add_argument("--trace", type=Path, default=None, metavar="FILE",
                     help="CSV of arrival_s,input_tokens,output_tokens,prefix_id[,prefix_tokens]")
    p.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                   help="workload parameter, as for `pdserve bench`")
    load = p.add_mutually_exclusive_group()
    load.add_argument("--rate", type=positive(float), default=None, metavar="R",
                      help="open loop: Poisson arrivals, R requests per second")
    load.add_argument("--concurrency", type=_count, default=None, metavar="C",
                      help="closed loop: C requests in flight, each sent when one ends")
    p.add_argument("--duration", type=positive(float), default=60.0, metavar="S",
                   help="seconds of sending requests")
    p.add_argument("--warmup", type=number(float, lambda v: v >= 0, ">= 0"), default=0.0, metavar="S",
                   help="leave requests sent in the first S seconds out of the figures")
    p.add_argument("--host-cores", type=number(float, lambda v: v >= 0, ">= 0"), default=None, metavar="N",
                   help="the workers share N CPU cores (CPU workers on one machine): a step takes longer by "
                        "busy workers / N when that is above 1; 0: every worker has its own device "
                        "(default: the profile's host_cores, prefill_host_cores and contentions, "
                        "measured by `pdserve profile --calibrate`; N sets both cores and no contention)")
    p.add_argument("--num-prefill", type=_count, default=1, metavar="N", help="prefill workers")
    p.add_argument("--num-decode", type=_count, default=1, metavar="N", help="decode workers")
    p.add_argument("--slo", default=None, metavar="SPEC",
                   help="ttft=...,itl=... (ms or s; a bare number is ms): goodput counts requests within "
                        "both (mean ITL per request); --search and --max-rate hold the p90s to them")
    p.add_argument("--search", action="store_true",
                   help="find the fewest workers, then the P:D split, meeting --slo at --rate")
    p.add_argument("--max-rate", action="store_true",
                   help="find the highest rate at which --num-prefill:--num-decode (or the --search result) "
                        "meets --slo")
    for role in ("prefill", "decode"):
        p.add_argument(f"--min-{role}", type=_count, default=1, metavar="N",
                       help=f"--search: fewest {role} workers")
        p.add_argument(f"--max-{role}", type=_count, default=64, metavar="N",
                       help=f"--search: most {role} workers")
    p.add_argument("--seed", type=int, default=0, metavar="N",
                   help="seed of arrivals and lengths")
    p.add_argument("--json", type=Path, default=None, metavar="FILE", help="also write the results as JSON")
    p.set_defaults(handler=run_simulate_command)


def _slo(args: argparse.Namespace, needed: bool) -> tuple[float, float] | None:
    if args.slo is None:
        if needed:
            raise ValueError("--slo: --search and --max-rate need ttft=... and itl=...")
        return None
    slo = parse_slo(args.slo)
    if slo.ttft is None or slo.itl is None:
        raise ValueError("--slo: give both ttft=... and itl=...")
    return slo.ttft, slo.itl


def _specs(args: argparse.Namespace, profile: Any, rate: float | None) -> Any:
    """The request specs: a list (open loop, a trace) or an endless iterator (closed loop)."""
    from planner.workload import bench_requests, read_trace

    if args.trace is not None:
        if args.concurrency is not None or args.rate is not None:
            raise ValueError("--trace: its arrival times set the load; drop --rate/--concurrency")
        return read_trace(args.trace)
    name = args.workload or "random"
    params = parse_params(args.param)
    if rate is None:
        return bench_requests(name, params, profile.model, seed=args.seed)
    n = max(1, round(rate * args.duration))
    return list(bench_requests(name, params, profile.model, seed=args.seed, rate=rate, num_requests=n))


def _print(r: Any, label: str) -> None:
    print(f"{label}: {r.completed}/{r.requests} requests done in {r.duration_s:.1f} s simulated "
          f"({r.events} events, {r.wall_s:.2f} s)")
    print(f"  throughput {r.request_throughput:.3f} req/s, {r.output_throughput:.1f} output tok/s"
          + ("" if math.isnan(r.goodput) else f", goodput {r.goodput:.3f} req/s "
             f"(SLO attainment {r.slo_attainment:.1%})"))
    for key in ("ttft", "itl", "e2e"):
        d = getattr(r, key)
        print(f"  {key.upper():4s} ms: mean {d.mean * 1000:.1f}  p50 {d.p50 * 1000:.1f}  "
              f"p90 {d.p90 * 1000:.1f}  p99 {d.p99 * 1000:.1f}")
    print(f"  utilisation: prefill {r.prefill_utilisation:.1%}, decode {r.decode_utilisation:.1%} "
          f"(mean decode batch {r.mean_decode_batch:.1f})")


def run_simulate_command(args: argparse.Namespace) -> int:
    from planner.profile import load_profile
    from planner.search import SloBounds, capacity_bounds, max_rate, smallest_cluster
    from planner.simulator import Cluster, simulate

    profile = load_profile(args.profile)
    slo = _slo(args, args.search or args.max_rate)
    if args.search and args.rate is None and args.trace is None:
        raise ValueError("--search: give the --rate to size for (or a --trace)")
    if args.max_rate and (args.trace is not None or args.concurrency is not None):
        raise ValueError("--max-rate: varies an open-loop --workload's rate; drop --trace/--concurrency")
    if not (args.search or args.max_rate) and args.rate is None and args.concurrency is None \
            and args.trace is None:
        raise ValueError("give one of --rate, --concurrency or --trace")
    out: dict[str, Any] = {"profile": str(args.profile)}
    host_cores = profile.host_cores if args.host_cores is None else (args.host_cores or None)
    prefill_cores = profile.prefill_host_cores if args.host_cores is None else None
    # --host-cores sets the wait for a core alone: no contention with it (0: every worker on its own device)
    contention = ((profile.decode_contention, profile.prefill_contention) if args.host_cores is None
                  else (1.0, 1.0))
    warm = args.warmup

    def run(p: int, d: int, specs: list[Any]) -> Any:
        return simulate(profile, Cluster(p, d), specs, concurrency=args.concurrency,
                        duration_s=args.duration if args.concurrency else None, slo=slo, warmup_s=warm,
                        host_cores=host_cores, prefill_host_cores=prefill_cores,
                        decode_contention=contention[0], prefill_contention=contention[1])

    p, d = args.num_prefill, args.num_decode
    if args.search:
        assert slo is not None
        specs = _specs(args, profile, args.rate)
        rate = args.rate or len(specs) / max(specs[-1].arrival_s, 1e-9)
        bounds = SloBounds(*slo)
        start = capacity_bounds(profile, specs, rate, bounds)
        t0 = time.perf_counter()
        found = smallest_cluster(lambda a, b: run(a, b, specs), bounds, (args.min_prefill, args.max_prefill),
                                 (args.min_decode, args.max_decode), start)
        took = time.perf_counter() - t0
        out["search"] = {"rate": rate, "capacity_lower_bounds": start, "seconds": took,
                         "simulations": found.evaluations,
                         "best": found.best,
                         "tried": {f"{a}P:{b}D": r.as_dict() for (a, b), r in found.tried.items()}}
        print(f"search at {rate:.4g} req/s: {found.evaluations} simulations in {took:.1f} s "
              f"(capacity lower bounds {start[0]}P, {start[1]}D)")
        if found.best is None or found.result is None:
            print(f"no split within {args.max_prefill}P:{args.max_decode}D meets the SLO")
            _dump(args.json, out)
            return 1
        p, d = found.best
        print(f"smallest cluster meeting the SLO: {p} prefill + {d} decode = {p + d} workers")
        _print(found.result, f"{p}P:{d}D")
    elif not args.max_rate:
        result = run(p, d, _specs(args, profile, args.rate))
        out["result"] = result.as_dict()
        _print(result, f"{p}P:{d}D")
    if args.max_rate:
        assert slo is not None
        t0 = time.perf_counter()
        best, res = max_rate(lambda rate: run(p, d, _specs(args, profile, rate)), SloBounds(*slo),
                             args.rate or 1.0)
        out["max_rate"] = {"num_prefill": p, "num_decode": d, "rate": best,
                           "seconds": time.perf_counter() - t0, "result": res.as_dict() if res else None}
        print(f"highest rate {p}P:{d}D meets the SLO at: {best:.4g} req/s "
              f"(search took {time.perf_counter() - t0:.1f} s)")
    _dump(args.json, out)
    return 0


def _dump(path: Path | None, out: dict[str, Any]) -> None:
    if path is not None:
        path.write_text(json.dumps(out, indent=2, default=str) + "\n")

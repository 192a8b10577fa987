"""One sitting of a comparison: loads run against servers with ``pdserve bench``'s client, results kept.

``Comparer.bench(url, name, workload, params, load)`` runs one load (``c4``: 4 clients in a closed loop;
``r0.5``: Poisson arrivals at 0.5 requests/s) for ``--duration`` seconds against a ready server, after
one short untimed request the first time it meets that server (lazy start-up is not measured), and
keeps the result as ``runs[name]`` (a ``Run``: the summary, every request and the server samples); the
summary is also written to ``--out``/``name``.json. Every run is greedy with ``ignore_eos`` (outputs
have the workload's lengths), seeded 0, and judged against the goodput SLO ``SLO_SPEC``.
``Comparer.pdserve(tag, *flags)`` is a ``pdserve serve`` with those flags on a free port, its log in
``--out``/``tag``.log.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from dataclasses import dataclass, field
from typing import Any

import httpx

from bench.client import BenchConfig, run_bench
from bench.report import metrics_summary, write_json
from bench.servers import free_port, pdserve_cmd, server
from bench.stats import RequestRecord, parse_slo, summarize
from bench.workloads import WordSource, describe, make_workload

SLO_SPEC = "ttft=2s,itl=250ms"


@dataclass
class Run:
    name: str
    workload: str
    load: str
    summary: dict[str, Any]
    records: list[RequestRecord] = field(repr=False)
    samples: list[dict[str, float]] = field(repr=False)


def ms(run: Run, key: str, q: str = "p50_ms") -> str:
    """A latency of ``run``'s summary in whole milliseconds for a table, ``-`` where there is none."""
    v = run.summary[key][q]
    return "-" if v is None or v != v else f"{v:,.0f}"


class Comparer:
    """``args`` carries ``duration`` (seconds of load per run), ``out`` (the raw results folder) and
    ``quiet`` (no progress bars)."""

    def __init__(self, args: argparse.Namespace, words: WordSource) -> None:
        self.args, self.words = args, words
        self.runs: dict[str, Run] = {}
        self.warm: set[str] = set()

    def bench(self, url: str, name: str, workload: str, params: dict[str, float], load: str,
              duration: float | None = None) -> Run:
        """Run one load (``c4`` = concurrency 4, ``r0.5`` = rate 0.5/s) for ``duration`` seconds (default:
        ``--duration``) and keep its results."""
        models = httpx.get(f"{url}/v1/models", timeout=30).json()["data"]
        if url not in self.warm:  # one short untimed request first: lazy initialisation is not measured
            self.warm.add(url)
            httpx.post(f"{url}/v1/completions", timeout=600,
                       json={"model": models[0]["id"], "prompt": "Hello", "max_tokens": 4})
        wl = make_workload(workload, params)
        conc = int(load[1:]) if load.startswith("c") else None
        rate = float(load[1:]) if load.startswith("r") else None
        cfg = BenchConfig(url=url, model=models[0]["id"], duration=duration or self.args.duration, rate=rate,
                          concurrency=conc, seed=0, metrics_interval=1.0, progress=not self.args.quiet,
                          drain_timeout=max(60.0, self.args.duration))
        print(f"compare: {name}: {workload} {load} for {cfg.duration:g} s", file=sys.stderr)
        result = run_bench(cfg, wl.sessions(self.words, 0), self.words.count)
        summary = summarize(result.records, result.duration, parse_slo(SLO_SPEC))
        summary["config"] = {"workload": describe(wl), "load": load, "duration_s": cfg.duration}
        summary["server_metrics"] = metrics_summary(result.samples)
        run = Run(name, workload, load, summary, result.records, result.samples)
        self.runs[name] = run
        write_json(self.args.out / f"{name}.json", summary)
        return run

    def pdserve(self, tag: str, *flags: str) -> contextlib.AbstractContextManager[str]:
        port = free_port()
        return server(pdserve_cmd(port, *flags), f"http://127.0.0.1:{port}", self.args.out / f"{tag}.log")

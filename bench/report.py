"""Write a run's results: ``summary.json``, ``requests.csv``, ``metrics.csv`` and PNG plots.

Plots use matplotlib's Agg backend (no display): ``latency_cdf.png`` (CDFs of
TTFT, TPOT, ITL and end-to-end latency), ``timeline.png`` (KV usage, KV memory
utilisation, queue depth and requests in flight over the run, from the sampled
server metrics; in-flight requests only when the server exposes none) and, for a
sweep, ``sweep.png`` (throughput, goodput and SLO attainment against the rate).
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.stats import RequestRecord

REQUEST_FIELDS = ("session", "turn", "label", "status", "start_s", "ttft_s", "tpot_s", "mean_itl_s", "e2e_s",
                  "prompt_tokens", "output_tokens", "error")


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _finite(obj: Any) -> Any:
    """NaN/inf -> None, so the JSON is strict."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_finite(v) for v in obj]
    return obj


def write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(_finite(data), indent=2, sort_keys=False) + "\n")


def write_requests_csv(path: Path, records: Sequence[RequestRecord], t0: float) -> None:
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(REQUEST_FIELDS)
        for r in records:
            w.writerow([r.session, r.turn, r.label, r.status, f"{r.start - t0:.4f}", r.ttft, r.tpot,
                        r.mean_itl, r.e2e, r.prompt_tokens, r.output_tokens, r.error])


def write_metrics_csv(path: Path, samples: Sequence[dict[str, float]]) -> None:
    keys = sorted({k for s in samples for k in s}, key=lambda k: (k != "t", k))
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(keys or ["t"])
        for s in samples:
            w.writerow([s.get(k, "") for k in keys])


def _cdf(ax: Any, values: Sequence[float], label: str) -> None:
    if not values:
        return
    xs = sorted(v * 1000 for v in values)
    ys = [(i + 1) / len(xs) for i in range(len(xs))]
    ax.step(xs, ys, where="post", label=label)


def plot_latency_cdfs(path: Path, runs: dict[str, Sequence[RequestRecord]], title: str = "") -> None:
    """One panel per latency (TTFT, TPOT, ITL, E2E), one CDF line per run."""
    plt = _plt()
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    panels = (("TTFT", lambda rs: [r.ttft for r in rs if r.ok and r.ttft is not None]),
              ("TPOT", lambda rs: [t for r in rs if (t := r.tpot) is not None]),
              ("ITL", lambda rs: [g for r in rs if r.ok for g in r.chunk_gaps]),
              ("E2E latency", lambda rs: [r.e2e for r in rs if r.ok and r.e2e is not None]))
    for ax, (name, pick) in zip(axes.flat, panels, strict=True):
        spread: list[float] = []
        for label, records in runs.items():
            values = pick(records)
            _cdf(ax, values, label)
            spread += [v for v in values if v > 0]
        log = bool(spread) and max(spread) > 20 * min(spread)
        if log:  # long tails (a stalled gap, a queued request) would squash the rest
            ax.set_xscale("log")
        ax.set_title(name)
        ax.set_xlabel("ms (log scale)" if log else "ms")
        ax.set_ylabel("fraction of requests" if name != "ITL" else "fraction of gaps")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def plot_timeline(path: Path, samples: Sequence[dict[str, float]], title: str = "") -> bool:
    """KV usage/utilisation and queue depth over time; False (nothing written) without samples."""
    if not samples:
        return False
    plt = _plt()
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    ts = [s["t"] for s in samples]
    for key, label in (("kv_usage", "KV blocks used (fraction)"),
                       ("kv_utilisation", "KV utilisation (tokens stored / slots held)")):
        if any(key in s for s in samples):
            ax1.plot(ts, [s.get(key, math.nan) for s in samples], label=label)
    ax1.set_ylim(0, 1.05)
    ax1.set_ylabel("fraction")
    ax1.grid(alpha=0.3)
    for key, label in (("queue_depth", "queue depth (server)"), ("running", "running (server)"),
                       ("client_in_flight", "in flight (client)")):
        if any(key in s for s in samples):
            ax2.plot(ts, [s.get(key, math.nan) for s in samples], label=label)
    ax2.set_xlabel("seconds into the run")
    ax2.set_ylabel("requests")
    ax2.grid(alpha=0.3)
    for ax in (ax1, ax2):
        if ax.lines:
            ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True


def plot_sweep(path: Path, points: Sequence[dict[str, Any]], target: float, title: str = "") -> None:
    """Throughput and goodput (requests/s) and SLO attainment against the offered rate."""
    plt = _plt()
    pts = sorted(points, key=lambda p: p["rate"])
    rates = [p["rate"] for p in pts]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ax1.plot(rates, [p["request_throughput"] for p in pts], "o-", label="throughput")
    ax1.plot(rates, [p["goodput"] for p in pts], "s-", label="goodput (SLO met)")
    ax1.plot(rates, rates, ":", color="gray", label="offered")
    ax1.set_xlabel("offered rate (sessions/s)")
    ax1.set_ylabel("requests/s")
    ax1.grid(alpha=0.3)
    ax1.legend(fontsize=8)
    ax2.plot(rates, [p["slo_attainment"] for p in pts], "o-")
    ax2.axhline(target, color="red", linestyle="--", label=f"target {target:.0%}")
    ax2.set_xlabel("offered rate (sessions/s)")
    ax2.set_ylabel("SLO attainment")
    ax2.set_ylim(0, 1.05)
    ax2.grid(alpha=0.3)
    ax2.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def write_run(out_dir: Path, summary: dict[str, Any], records: Sequence[RequestRecord],
              samples: Sequence[dict[str, float]], t0: float, title: str = "") -> list[Path]:
    """Write the files of one run into ``out_dir``; returns their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / "summary.json", out_dir / "requests.csv", out_dir / "metrics.csv",
             out_dir / "latency_cdf.png"]
    write_json(paths[0], summary)
    write_requests_csv(paths[1], records, t0)
    write_metrics_csv(paths[2], samples)
    plot_latency_cdfs(paths[3], {title or "run": records}, title)
    if plot_timeline(out_dir / "timeline.png", samples, title):
        paths.append(out_dir / "timeline.png")
    return paths


def metrics_summary(samples: Sequence[dict[str, float]]) -> dict[str, float | None]:
    """Means and maxima of the sampled server metrics (None when the server exposed none)."""
    out: dict[str, float | None] = {}
    for key in ("kv_usage", "kv_utilisation", "queue_depth", "running"):
        values = [s[key] for s in samples if key in s]
        out[f"{key}_mean"] = sum(values) / len(values) if values else None
        out[f"{key}_max"] = max(values) if values else None
    stored = sum(s.get("kv_stored_tokens", 0.0) for s in samples)
    slots = sum(s.get("kv_token_slots", 0.0) for s in samples)
    out["kv_utilisation_pooled"] = stored / slots if slots else None
    return out

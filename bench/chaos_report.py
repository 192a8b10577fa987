"""The chaos run's report: requests by phase and outcome, errors with their reasons, faults by kind,
greedy texts checked, the workers' end state, RSS before and after, TTFT, and the checks."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from bench.chaos_checks import BUSY_FIELDS, Check, figure
from bench.chaos_load import ALLOWED_ERRORS, Outcome
from bench.stats import percentile

PHASES = ("reference", "load", "burst", "after")
KINDS = ("ok", "cancelled", "fault_error", "violation")


@dataclass
class Report:
    config: dict[str, Any]
    outcomes: dict[str, dict[str, int]]  # phase -> kind -> count
    errors: list[dict[str, Any]]  # one row per (status, code, kind): count and why
    violations: list[dict[str, Any]]
    faults: dict[str, int]
    kills: list[dict[str, Any]]
    greedy_checked: int
    greedy_equal: int
    end_state: list[dict[str, Any]]
    rss_mb: dict[str, dict[str, Any]]
    ttft_ms: dict[str, float]
    checks: list[Check] = field(default_factory=list)
    changes: list[dict[str, Any]] = field(default_factory=list)  # the graceful drain and the worker added

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks) and not self.violations


def summarize(config: dict[str, Any], outcomes: list[Outcome], kills: list[dict[str, Any]],
              pull_failures: dict[str, int], end: list[dict[str, Any]],
              rss_before: dict[str, tuple[int, float | None]], rss_after: dict[str, tuple[int, float | None]],
              checks: list[Check], changes: list[dict[str, Any]] | None = None) -> Report:
    by_phase = {p: {k: sum(1 for o in outcomes if o.phase == p and o.kind == k) for k in KINDS}
                for p in PHASES}
    errors = Counter((o.status, o.code, o.stream) for o in outcomes if o.kind == "fault_error")
    error_rows = [{"status": s, "code": c, "where": "stream error event" if s == 200 else "HTTP status",
                   "count": n, "why": ALLOWED_ERRORS.get(503 if s == 200 else s, {}).get(c, "")}
                  for (s, c, _), n in sorted(errors.items())]
    for row in error_rows:  # a stream's error event carries the code of the status it stands for
        row["why"] = row["why"] or next((why for codes in ALLOWED_ERRORS.values()
                                         for code, why in codes.items() if code == row["code"]), "")
    violations = [o.as_dict() for o in outcomes if o.kind == "violation"]
    faulted = [o for o in outcomes if o.phase in ("load", "burst")]
    faults = {
        "kill prefill worker": sum(1 for k in kills if k.get("role") == "prefill" and k["killed"]),
        "kill decode worker": sum(1 for k in kills if k.get("role") == "decode" and k["killed"]),
        "KV pull failures (worker stats)": sum(pull_failures.values()),
        "client disconnects": sum(1 for o in faulted if o.kind == "cancelled"),
        "burst requests": sum(1 for o in outcomes if o.phase == "burst"),
        "graceful drains": sum(1 for c in changes or [] if c["change"] == "drain" and c.get("status") == 200),
        "workers added": sum(1 for c in changes or [] if c["change"] == "add" and c.get("status") == 200),
    }
    checked = [o for o in outcomes if o.greedy_checked]
    ttfts = [o.ttft for o in faulted if o.kind == "ok" and o.stream and o.ttft is not None]
    state = [{"worker": w["worker_id"], "pid": w["pid"], **{f: figure(w, f) for f in BUSY_FIELDS},
              "cached_blocks": figure(w, "kv.cached_blocks")}
             for w in sorted(end, key=lambda w: w["worker_id"])]
    rss = {name: {"pid_before": pid, "before": mb, "pid_after": rss_after.get(name, (0, None))[0],
                  "after": rss_after.get(name, (0, None))[1]} for name, (pid, mb) in rss_before.items()}
    return Report(config, by_phase, error_rows, violations, faults, kills,
                  len(checked), sum(1 for o in checked if o.kind == "ok"), state, rss,
                  {"count": len(ttfts), "p50": 1000 * percentile(ttfts, 50),
                   "p99": 1000 * percentile(ttfts, 99)},
                  checks, list(changes or []))


def render(r: Report) -> str:
    c = r.config
    lines = [f"chaos run: {c['duration']:.0f} s, seed {c['seed']}, concurrency {c['concurrency']}, "
             f"faults {'on' if c['faults'] else 'off'}", "", "requests by outcome",
             f"  {'phase':10s}" + "".join(f"{k:>13s}" for k in KINDS)]
    for phase, kinds in r.outcomes.items():
        lines.append(f"  {phase:10s}" + "".join(f"{kinds[k]:13d}" for k in KINDS))
    lines += ["", "clean errors (documented)"]
    lines += [f"  {e['status']} {e['code']:15s} {e['where']:18s} {e['count']:5d}  {e['why']}"
              for e in r.errors]
    lines += ["  none"] if not r.errors else []
    lines += ["", "faults injected"] + [f"  {k:34s} {v:6d}" for k, v in r.faults.items()]
    lines += [f"  at {c.get('t', '?')} s: {c['change']} {c.get('worker_id') or c.get('role')}: "
              f"{c.get('status')} in {c.get('seconds')} s" + (f", {c['moved']} moved" if "moved" in c else "")
              + (f" ({c['error']})" if "error" in c else "") for c in r.changes]
    lines += ["", f"greedy texts checked {r.greedy_checked}, equal {r.greedy_equal}", "",
              "end state per worker (used blocks, running, waiting, leases, reserved, cached)"]
    lines += [f"  {w['worker']:10s} pid {w['pid']:7d}  " + "  ".join(str(w[f]) for f in BUSY_FIELDS)
              + f"  cached {w['cached_blocks']}" for w in r.end_state]
    lines += ["", "RSS MiB before -> after"]
    for name, v in r.rss_mb.items():
        note = ("  (drained and removed)" if not v["pid_after"] else
                "  (restarted)" if v["pid_before"] != v["pid_after"] else "")
        lines.append(f"  {name:10s} {_mb(v['before']):>6s} -> {_mb(v['after']):>6s}{note}")
    t = r.ttft_ms
    lines += ["", f"TTFT of completed streamed requests under load: p50 {t['p50']:.0f} ms, "
                  f"p99 {t['p99']:.0f} ms ({t['count']:.0f} requests)", "", "checks"]
    lines += [f"  {'PASS' if k.passed else 'FAIL'}  {k.name}: {k.figure}" for k in r.checks]
    lines += [f"  FAIL  violation: {v['phase']} spec {v['spec']} stream={v['stream']} n={v['n']}: "
              f"{v['status']} {v['code']} {v['detail']}" for v in r.violations[:20]]
    lines.append(f"\nresult: {'PASS' if r.passed else 'FAIL'}")
    return "\n".join(lines)


def _mb(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.0f}"

"""The chaos run's end-of-run checks, over the server's HTTP API (and, where reachable, /proc and Ray).

After the load stops the cluster is given ``settle_timeout`` seconds to come back: every configured
worker listed by ``/v1/workers`` (killed ones restarted by Ray and rejoined), none holding a used
block, a running or waiting request, a lease or a reservation, and ``/health`` 200. Then:

- ``/v1/prefix_index`` agrees for every worker (the router's index equals each worker's cached blocks);
- RSS: each process (the router when its pid is known, and every worker, by worker id: a restarted one
  is a new process on the same id; a drained one is gone, one added later has no "before") is at most
  ``rss_factor`` x its RSS after warm-up plus ``rss_slack_mb`` MiB (read from ``/proc``; workers on
  another host are reported as not checked);
- Ray: when this process is connected to the server's Ray, the actors and placement groups named with
  the server's prefix that are not dead/removed number exactly the configured workers.

Each check is one :class:`Check` (name, passed, figure); the run passes when all do.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

# what a worker still holds, as paths into its /v1/workers entry (messages.wire.WorkerStats)
BUSY_FIELDS = ("kv.used_blocks", "requests.running", "requests.waiting", "leases.held", "requests.reserved")


@dataclass
class Check:
    name: str
    passed: bool
    figure: str


async def workers(client: httpx.AsyncClient, url: str) -> list[dict[str, Any]]:
    """``/v1/workers``' list, or empty while it cannot answer (a worker restarting)."""
    try:
        resp = await client.get(f"{url}/v1/workers", timeout=10)
    except httpx.HTTPError:
        return []
    return list(resp.json().get("workers", [])) if resp.status_code == 200 else []


def figure(worker: dict[str, Any], path: str) -> Any:
    """The value at a dotted ``path`` of a worker's /v1/workers entry (0 when it has none)."""
    value: Any = worker
    for key in path.split("."):
        value = value.get(key, 0) if isinstance(value, dict) else 0
    return value


def busy(stats: list[dict[str, Any]]) -> dict[str, dict[str, int]]:
    return {w["worker_id"]: {f: figure(w, f) for f in BUSY_FIELDS if figure(w, f)} for w in stats}


async def settle(client: httpx.AsyncClient, url: str, num_workers: int,
                 timeout: float) -> tuple[list[dict[str, Any]], float]:
    """Wait until ``num_workers`` workers answer, idle, and /health is 200; (their stats, seconds taken).
    On timeout, the last stats seen (the checks then fail and show what was held)."""
    t0 = time.monotonic()
    stats: list[dict[str, Any]] = []
    while time.monotonic() - t0 < timeout:
        stats = await workers(client, url)
        if len(stats) == num_workers and not any(busy(stats).values()):
            try:
                health = await client.get(f"{url}/health", timeout=10)
            except httpx.HTTPError:
                health = None
            if health is not None and health.status_code == 200:
                return stats, time.monotonic() - t0
        await asyncio.sleep(0.5)
    return stats, time.monotonic() - t0


async def index_agreement(client: httpx.AsyncClient, url: str, timeout: float) -> dict[str, Any]:
    """``/v1/prefix_index`` once it agrees, or the last answer after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    body: dict[str, Any] = {}
    while True:
        try:
            resp = await client.get(f"{url}/v1/prefix_index", timeout=10)
            body = resp.json() if resp.status_code == 200 else {"agrees": False, "error": resp.text[:200]}
        except httpx.HTTPError as exc:
            body = {"agrees": False, "error": repr(exc)}
        if body.get("agrees") or time.monotonic() > deadline:
            return body
        await asyncio.sleep(0.5)


def rss_mb(pid: int) -> float | None:
    """Resident set size of a local process in MiB (None when it is not on this host)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except (OSError, ValueError):
        return None
    return None


def rss_table(stats: list[dict[str, Any]], router_pid: int | None) -> dict[str, tuple[int, float | None]]:
    """Process name -> (pid, RSS MiB): the router's (when known) and each worker's."""
    out: dict[str, tuple[int, float | None]] = {}
    if router_pid:
        out["router"] = (router_pid, rss_mb(router_pid))
    for w in stats:
        out[w["worker_id"]] = (int(w["pid"]), rss_mb(int(w["pid"])))
    return out


def rss_checks(before: dict[str, tuple[int, float | None]], after: dict[str, tuple[int, float | None]],
               factor: float, slack_mb: float) -> list[Check]:
    checks = []
    for name, (pid0, mb0) in sorted(before.items()):
        if name not in after and name != "router":  # the drained worker: its actor is gone
            checks.append(Check(f"rss {name}", True, f"{mb0 or 0:.0f} MiB, then drained and removed"))
            continue
        pid1, mb1 = after.get(name, (0, None))
        if mb0 is None or mb1 is None:
            checks.append(Check(f"rss {name}", True, "not checked (not a local process)"))
            continue
        bound = factor * mb0 + slack_mb
        restarted = " (restarted)" if pid1 != pid0 else ""
        checks.append(Check(f"rss {name}", mb1 <= bound,
                            f"{mb0:.0f} -> {mb1:.0f} MiB{restarted}, bound {bound:.0f}"))
    return checks


def ray_census(worker_pids: set[int], expected: int) -> Check | None:
    """Live actors and placement groups of the server owning ``worker_pids`` (names share its prefix);
    None when this process is not connected to that Ray."""
    import ray

    if not ray.is_initialized():
        return None
    from ray._private.state import actors as actor_table
    from ray.util import placement_group_table

    table = actor_table()
    ours = [a for a in table.values() if int(a.get("Pid") or 0) in worker_pids and a.get("Name")]
    if not ours:
        return Check("ray actors and placement groups", False, "no actor of this server found in Ray")
    prefix = str(ours[0]["Name"]).rsplit("-", 2)[0] + "-"
    alive = [a["Name"] for a in table.values()
             if str(a.get("Name") or "").startswith(prefix) and a.get("State") != "DEAD"]
    groups = [g.get("name") for g in placement_group_table().values()
              if str(g.get("name") or "").startswith(prefix) and g.get("state") != "REMOVED"]
    ok = len(alive) == expected and len(groups) in (0, expected)
    return Check("ray actors and placement groups", ok,
                 f"{len(alive)} actors, {len(groups)} placement groups (configured {expected})")

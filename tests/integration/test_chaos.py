"""The short chaos soak (``bench.chaos``) against a real ``pdserve serve`` with 2 prefill and 2 decode
workers: worker SIGKILLs, injected KV-pull failures, client disconnects, a burst, and a graceful drain
followed by a new worker (``POST /v1/workers``), all under load; then every request's outcome is judged
and the cluster must come back whole (nothing held, index in agreement, RSS bounded, no extra Ray actor
or placement group)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING

import httpx
import pytest

from bench.chaos import ChaosConfig, run_chaos
from bench.chaos_report import render

if TYPE_CHECKING:
    from tests.integration.conftest import PdserveServer

pytestmark = pytest.mark.slow

KEY = "chaos-key"


def test_short_chaos_soak(pdserve_factory: Callable[..., PdserveServer]) -> None:
    server = pdserve_factory("--num-prefill", "2", "--num-decode", "2", "--max-restarts", "100",
                             "--inject-transfer-failures", "0.1", "--api-key", KEY)
    cfg = ChaosConfig(duration=30, seed=1, concurrency=3, kill_interval=12, burst_factor=6, num_specs=12,
                      settle_timeout=150)
    auth = {"Authorization": f"Bearer {KEY}"}
    bodies: list[tuple[dict[str, object], str]] = [
        ({"role": "router"}, "role"), ({}, "role"), ({"role": "decode", "extra": 1}, "extra")]
    for body, param in bodies:
        bad = httpx.post(f"{server.url}/v1/workers", json=body, headers=auth, timeout=10)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == param, bad.text
    assert httpx.post(f"{server.url}/v1/workers", json={"role": "decode"}, timeout=10).status_code == 401
    report = asyncio.run(run_chaos(cfg, server.url, KEY, server.process.pid))
    text = render(report)
    assert report.passed, text + "\n" + server.log_tail()
    assert report.violations == [], text
    assert report.faults["kill prefill worker"] + report.faults["kill decode worker"] == 2, text
    assert report.faults["client disconnects"] > 0 and report.faults["burst requests"] == 18, text
    assert report.faults["KV pull failures (worker stats)"] > 0, text
    assert report.faults["graceful drains"] == 1 and report.faults["workers added"] == 1, text
    drained, added = report.changes
    assert added["worker_id"] not in (drained["worker_id"], None), text
    assert drained["worker_id"] not in {w["worker"] for w in report.end_state}, text
    assert report.greedy_checked > 0 and report.greedy_equal == report.greedy_checked, text
    assert len(report.end_state) == 4, text
    held = ("kv.used_blocks", "leases.held", "requests.reserved")  # bench.chaos_checks.BUSY_FIELDS
    assert all(w[f] == 0 for w in report.end_state for f in held), text
    assert {c.name for c in report.checks} >= {"prefix index agrees", "ray actors and placement groups"}, text

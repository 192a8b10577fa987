"""The P:D split changing under real load, over real HTTP against `pdserve serve --planner` on Ray.

One server (1 prefill, 1 decode, ``--max-decode 2``, one batch slot per worker) and one closed-loop
load of streaming chat requests (greedy, fixed lengths) run through the module. With two streams and
one decode slot, each request's first token (computed by prefill) comes at once but the rest waits
for the other request to finish: its inter-token latency (time per output token after the first)
doubles, which breaks the ITL SLO; a second decode worker gives each stream a slot. The tests run in
order:

1. load rises: the planner (the simulator's ``recommend`` with a profile measured on this machine,
   plus the measured SLO breach) adds a decode worker, and the ITL p90 of requests sent after it
   joined meets the SLO it broke before;
2. the load falls and the planner drains and removes a decode worker, down to one.

The drain itself (under load, through the admin endpoint, no planner) is ``test_drain.py``, which
the default run includes.

Every request of the module must complete with the text the same prompt gets alone (nothing lost,
nothing disturbed), and the planner's decisions must show in ``/metrics``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from tests.integration.closed_loop import (
    Load,
    chat_body,
    decode_ids,
    lost_or_disturbed,
    metric,
    p90,
    references,
    wait_for,
    workers,
)

if TYPE_CHECKING:
    from tests.integration.conftest import PdserveServer

# Load-sensitive: the planner's SLO is an ITL between one and two decode workers' figures on this machine,
# which the rest of the suite running beside it moves; run alone with `pytest -n 0 -m load_sensitive`.
pytestmark = [pytest.mark.slow, pytest.mark.load_sensitive]

KEY = "planner-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MODEL = "tiny"
PROFILE = Path(__file__).resolve().parents[1] / "data" / "planner_profile.json"  # pdserve profile --quick
SLO_TTFT_S = 2.0
SLO_ITL_S = 0.10
MAX_TOKENS = 24
HIGH, LOW = 2, 1  # concurrent streams: twice the one decode worker's one slot, then one stream
PROMPTS = [f"Describe the harbour of city number {i} in a few sentences." for i in range(4)]


@pytest.fixture(scope="module")
def server(pdserve_factory: Callable[..., PdserveServer]) -> PdserveServer:
    return pdserve_factory(
        "--num-prefill", "1", "--num-decode", "1", "--max-num-seqs", "1", "--routing", "least-loaded",
        "--api-key", KEY, "--served-model-name", MODEL,
        "--planner", "--planner-profile", str(PROFILE), "--min-decode", "1", "--max-decode", "2",
        "--slo", f"ttft={SLO_TTFT_S},itl={SLO_ITL_S}", "--planner-interval", "3", "--planner-hysteresis", "2",
        "--planner-drain-deadline", "60")


def body(prompt: str, stream: bool) -> dict[str, Any]:
    return chat_body(MODEL, prompt, MAX_TOKENS, stream)


@pytest.fixture(scope="module")
def load(server: PdserveServer) -> Iterator[Load]:
    refs = references(server, AUTH, PROMPTS, partial(body, stream=False))
    running = Load(server.url, AUTH, PROMPTS, partial(body, stream=True), HIGH, refs)
    yield running
    running.close()


def test_load_rises_planner_adds_a_decode_worker_and_the_slo_recovers(server: PdserveServer,
                                                                       load: Load) -> None:
    assert decode_ids(server, AUTH) == (["decode-0"], [])
    started = time.monotonic()
    load.start(HIGH)
    joined = wait_for("the planner adds a decode worker",
                      lambda: len(decode_ids(server, AUTH)[0]) == 2, 240, server)
    before = [r.itl for r in load.since(started + 3) if r.started < joined - 3 and r.itl is not None]
    print(f"ITL with one decode worker: p90 {p90(before) if before else None} s over {len(before)}")
    assert before and p90(before) > SLO_ITL_S, before  # one decode worker broke the SLO ...
    settled = joined + 6  # a fresh worker's first requests run slower
    wait_for("requests sent after the join", lambda: len(load.since(settled)) >= 8, 120)
    after = [r.itl for r in load.since(settled) if r.itl is not None]
    print(f"ITL with two: p90 {p90(after)} s over {len(after)}; joined {joined - started:.1f} s in")
    print(server.log_tail(30))
    assert p90(after) < SLO_ITL_S, after  # ... two meet it
    assert metric(server, AUTH, "pdserve:planner_decisions_total", action="add", role="decode") >= 1
    assert metric(server, AUTH, "pdserve:planner_workers", role="decode") == 2


def test_load_falls_planner_drains_and_removes_a_worker(server: PdserveServer, load: Load) -> None:
    assert len(decode_ids(server, AUTH)[0]) == 2  # the one the planner added under the high load
    load.target = LOW  # once the load falls it drains and removes one
    def one_left() -> bool:
        routed, draining = decode_ids(server, AUTH)
        return len(routed) == 1 and not draining

    wait_for("the planner drains down to one decode worker", one_left, 240, server)
    assert metric(server, AUTH, "pdserve:planner_decisions_total", action="remove", role="decode") >= 1
    assert metric(server, AUTH, "pdserve:planner_workers", role="decode") == 1
    load.close()
    bad = lost_or_disturbed(load, MAX_TOKENS)
    assert not bad, f"{len(bad)} of {len(load.records)} requests lost or disturbed: {bad[:5]}"
    ids = [w["worker_id"] for w in workers(server, AUTH)["workers"]]
    assert len([i for i in ids if i.startswith("decode-")]) == 1 and "prefill-0" in ids

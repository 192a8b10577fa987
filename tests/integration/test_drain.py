"""Graceful drain under load, over real HTTP against `pdserve serve` on Ray (no planner).

One server (1 prefill, 2 decode workers, least-loaded routing) and two closed-loop streaming clients
(greedy, fixed lengths), so both decode workers stream at all times. A decode worker is drained
through the admin endpoint while it streams a request: every request completes with the text its
prompt gets alone, the worker's final stats show no block, request, reservation, lease or cached
block, no request sent once the drain began reaches it, its actor leaves ``/v1/workers``, and a
second drain of it is a 404. No latency is asserted: the test holds on a loaded machine.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from functools import partial
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from tests.integration.closed_loop import (
    Load,
    Record,
    chat_body,
    decode_ids,
    lost_or_disturbed,
    references,
    wait_for,
    workers,
)

if TYPE_CHECKING:
    from tests.integration.conftest import PdserveServer

pytestmark = pytest.mark.slow

KEY = "drain-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MODEL = "tiny"
MAX_TOKENS = 32
CLIENTS = 2
PROMPTS = [f"Describe the harbour of city number {i} in a few sentences." for i in range(2)]
# what a worker still holds: (part, figure) of its WorkerStats as JSON; the cached blocks last
HELD = (("kv", "used_blocks"), ("requests", "running"), ("requests", "waiting"), ("requests", "reserved"),
        ("leases", "held"), ("kv", "cached_blocks"))


@pytest.fixture(scope="module")
def server(pdserve_factory: Callable[..., PdserveServer]) -> PdserveServer:
    return pdserve_factory("--num-prefill", "1", "--num-decode", "2", "--routing", "least-loaded",
                           "--api-key", KEY, "--served-model-name", MODEL)


@pytest.fixture(scope="module")
def load(server: PdserveServer) -> Iterator[Load]:
    refs = references(server, AUTH, PROMPTS, partial(chat_body, MODEL, max_tokens=MAX_TOKENS, stream=False))
    running = Load(server.url, AUTH, PROMPTS, partial(chat_body, MODEL, max_tokens=MAX_TOKENS, stream=True),
                   CLIENTS, refs)
    running.start(CLIENTS)
    yield running
    running.close()


def test_bad_drain_calls_are_refused(server: PdserveServer) -> None:
    for bad, param in (({"deadline_s": -1}, "deadline_s"), ({"deadline_s": 5, "when": 1}, "when")):
        resp = httpx.post(f"{server.url}/v1/workers/decode-0/drain", headers=AUTH, json=bad, timeout=10)
        assert resp.status_code == 400 and resp.json()["error"]["param"] == param, resp.text
    assert httpx.post(f"{server.url}/v1/workers/decode-0/drain", timeout=10).status_code == 401
    missing = httpx.post(f"{server.url}/v1/workers/decode-9/drain", headers=AUTH, timeout=10)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "worker_not_found", missing.text


def test_decode_worker_drained_under_load(server: PdserveServer, load: Load) -> None:
    routed, _ = decode_ids(server, AUTH)
    assert routed == ["decode-0", "decode-1"]
    victim = "decode-0"
    busy: list[Record] = []  # streaming, less than half done, when the drain is called: they finish there

    def streaming() -> bool:
        busy[:] = load.running(victim, MAX_TOKENS // 2)
        return bool(busy)

    wait_for(f"{victim} streams a request", streaming, 60, server)
    reply: dict[str, Any] = {}

    def drain() -> None:
        resp = httpx.post(f"{server.url}/v1/workers/{victim}/drain", headers=AUTH, json={"deadline_s": 60},
                          timeout=120)
        reply.update(status=resp.status_code, body=resp.json())

    thread = threading.Thread(target=drain)
    thread.start()
    # from here on the router must not route to it (a request sent earlier may still be on its way)
    marked = wait_for(f"{victim} draining",
                      lambda: victim in decode_ids(server, AUTH)[1] or "status" in reply, 30)
    thread.join(120)
    assert not thread.is_alive() and reply["status"] == 200, reply
    report = reply["body"]
    assert (report["worker_id"], report["moved"]) == (victim, 0), report
    assert {(a, b): report["final"][a][b] for a, b in HELD} == dict.fromkeys(HELD, 0), report["final"]
    assert victim not in [w["worker_id"] for w in workers(server, AUTH)["workers"]]
    wait_for("requests sent after the drain began", lambda: len(load.since(marked)) >= 4, 120)
    load.close()
    after = [(r.worker, round(r.started - marked, 2)) for r in load.records if r.started >= marked]
    assert all(w == "decode-1" for w, _ in after), after
    assert busy and all(r.ended is not None and r.status == 200 for r in busy), busy
    assert not lost_or_disturbed(load, MAX_TOKENS), lost_or_disturbed(load, MAX_TOKENS)[:5]
    again = httpx.post(f"{server.url}/v1/workers/{victim}/drain", headers=AUTH, timeout=10)
    assert again.status_code == 404 and again.json()["error"]["code"] == "worker_not_found", again.text
    assert sorted(w["worker_id"] for w in workers(server, AUTH)["workers"]) == ["decode-1", "prefill-0"]

    def idle() -> bool:  # the KV the load held elsewhere is freed too (leases once their pulls are noted)
        return all(w[a][b] == 0 for w in workers(server, AUTH)["workers"] for a, b in HELD[:5])

    wait_for("every lease, reservation and used block freed", idle, 30, server)


def test_drain_past_its_deadline_moves_running_requests_on(server: PdserveServer, load: Load) -> None:
    """A worker added, then a streaming decode worker drained with a 50 ms deadline: it is retired at once
    with what it runs, and those requests finish on the other worker (migrated with their tokens so far),
    each with the text its prompt gets alone. Found by the chaos soak: they ended in a 500."""
    added = httpx.post(f"{server.url}/v1/workers", headers=AUTH, json={"role": "decode"}, timeout=180)
    assert added.status_code == 200, added.text
    newcomer, victim = added.json()["worker_id"], "decode-1"
    running = Load(server.url, AUTH, PROMPTS, partial(chat_body, MODEL, max_tokens=MAX_TOKENS, stream=True),
                   CLIENTS, load.references)
    running.start(CLIENTS)
    try:
        busy: list[Record] = []

        def streaming() -> bool:
            busy[:] = running.running(victim, MAX_TOKENS // 2)
            return bool(busy)

        wait_for(f"{victim} streams a request", streaming, 60, server)
        resp = httpx.post(f"{server.url}/v1/workers/{victim}/drain", headers=AUTH, json={"deadline_s": 0.05},
                          timeout=120)
        assert resp.status_code == 200, resp.text
        report = resp.json()
        assert report["worker_id"] == victim and report["moved"] >= 1 and report["final"] is None, report
        wait_for("the moved requests end", lambda: all(r.ended is not None for r in busy), 120, server)
    finally:
        running.close()
    assert not lost_or_disturbed(running, MAX_TOKENS), lost_or_disturbed(running, MAX_TOKENS)[:5]
    assert all(r.status == 200 for r in busy), busy
    assert sorted(w["worker_id"] for w in workers(server, AUTH)["workers"]) == [newcomer, "prefill-0"]

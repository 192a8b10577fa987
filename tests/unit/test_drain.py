"""The router's bookkeeping of workers joining and leaving (no Ray: the handles wrap plain objects), the
load window the planner reads, and the planner's flags."""

from __future__ import annotations

import asyncio

import pytest

from cli.main import main
from cluster.config import PlannerOptions, ServeConfig, parse_slo
from engine.sampling_params import SamplingParams
from messages.wire import GenerateRequest
from router.drain import Drainer
from router.errors import DrainRefused
from router.handles import WORKER_DIED, DecodeHandle, PrefillHandle
from router.load import Chooser
from router.load_window import LoadWindow, Served
from router.policy import LeastLoaded
from router.worker_table import WorkerState, WorkerTable
from tests.fakes import FakeActor, SilentStream


def table() -> WorkerTable:
    t = WorkerTable([PrefillHandle(FakeActor())], [DecodeHandle(FakeActor()), DecodeHandle(FakeActor())], 1.0)
    for w, name in zip(t.all(), ("prefill-0", "decode-0", "decode-1"), strict=True):
        w.worker_id = name
    return t


def request(rid: str) -> GenerateRequest:
    return GenerateRequest(request_id=rid, prompt_token_ids=list(range(20)),
                           sampling=SamplingParams(max_tokens=4))


def test_draining_worker_leaves_routing_at_once_and_is_never_revived() -> None:
    t = table()
    chooser = Chooser(t, LeastLoaded(), pending_ttl=30, settle_ttl=5)
    drainer = Drainer(t, chooser, 1.0)
    d0, d1 = t.decode
    held = chooser.pick("decode", [d1], request("r1"))
    assert chooser.in_flight(d1) == 1 and chooser.in_flight(d0) == 0
    revived: list[str] = []

    async def revive(w: WorkerState) -> None:
        revived.append(w.worker_id)

    t.on_revive = revive
    assert drainer.begin("decode-1") is d1
    assert [w.worker_id for w in t.live("decode")] == ["decode-0"] and t.draining() == ["decode-1"]
    for i in range(4):  # every choice from now on skips it
        assert chooser.pick("decode", t.live("decode"), request(f"n{i}")).worker is d0

    async def die() -> tuple[int, int]:  # within a loop, where revival tasks can start
        t.mark_dead(d1)  # its process died while draining: no revival
        draining_revivals = len(t._revivals)
        other = WorkerTable([], [DecodeHandle(FakeActor())], 1.0)
        other.on_revive = revive
        other.mark_dead(other.decode[0])  # a worker not draining is waited for
        serving_revivals = len(other._revivals)
        await other.stop()
        return draining_revivals, serving_revivals

    assert asyncio.run(die()) == (0, 1)
    chooser.release(held.worker, "r1", ok=True)
    assert chooser.in_flight(d1) == 0
    t.remove(d1)
    assert [w.worker_id for w in t.decode] == ["decode-0"] and t.draining() == []


def test_drain_refusals() -> None:
    t = table()
    drainer = Drainer(t, Chooser(t, LeastLoaded(), 30, 5), 1.0)
    with pytest.raises(DrainRefused) as unknown:
        drainer.begin("decode-9")
    assert (unknown.value.status, unknown.value.code) == (404, "worker_not_found")
    with pytest.raises(DrainRefused) as last:
        drainer.begin("prefill-0")
    assert (last.value.status, last.value.code) == (409, "last_worker")
    drainer.begin("decode-0")
    for worker_id, code in (("decode-0", "already_draining"), ("decode-1", "last_worker")):
        with pytest.raises(DrainRefused) as refused:
            drainer.begin(worker_id)
        assert (refused.value.status, refused.value.code) == (409, code)


def test_added_workers_get_fresh_indexes() -> None:
    t = table()
    t.remove(t.decode[1])
    added = t.add("decode", DecodeHandle(FakeActor()), "decode-2")
    assert [(w.worker_id, w.index) for w in t.decode] == [("decode-0", 0), ("decode-2", 2)]
    assert t.find("decode-2") is added and t.live("decode")[-1] is added


def test_load_window_takes_and_restarts() -> None:
    window = LoadWindow()
    window.arrived(100)
    window.arrived(50)
    window.first(0.5, 100, 64, 1)
    window.later(4)
    window.later(0)
    window.done(0.2, 5)  # 0.2 s for the 4 tokens after the first
    window.first(0.25, 50, 0, 1)
    window.done(0.0, 1)  # a single token: no inter-token latency
    served = window.take()
    assert (served.requests, served.prompt_tokens, served.first_prompt_tokens, served.cached_tokens) == (
        2, 150, 150, 64)
    assert (served.ttft, served.itl, served.output_tokens, served.finished) == ([0.5, 0.25], [0.05], 6, 2)
    assert served.seconds > 0
    assert window.take().requests == 0
    merged = Served.merge([served, served])
    assert (merged.requests, merged.itl, merged.seconds) == (4, [0.05, 0.05], 2 * served.seconds)


def test_slo_and_planner_flags(capsys: pytest.CaptureFixture[str]) -> None:
    assert parse_slo("ttft=1,itl=50ms") == (1.0, 0.05)
    assert parse_slo(" itl=0.2s , ttft=800ms ") == (0.8, 0.2)
    for text, needle in (("ttft=1", "give both"), ("ttft=1,itl=x", "invalid time"), ("ttft=0,itl=1", "> 0"),
                         ("e2e=1,itl=1", "expected ttft=SECONDS")):
        with pytest.raises(ValueError, match=needle):
            parse_slo(text)
    for argv, needle in ((["--planner"], "--planner needs --planner-profile"),
                         (["--slo", "ttft=1"], "argument --slo: give both"),
                         (["--planner", "--planner-profile", "p.json", "--num-decode", "3",
                           "--max-decode", "2"],
                          "--num-decode 3 must lie within --min-decode 3 and --max-decode 2"),
                         (["--planner", "--planner-profile", "p.json", "--num-prefill", "0"],
                          "--planner needs prefill workers")):
        assert main(["serve", *argv]) == 2, argv
        assert needle in capsys.readouterr().err, argv
    options = PlannerOptions(enabled=True, profile="p.json", max_decode=4)
    assert options.bounds(1, 2) == (1, 1, 2, 4)
    assert ServeConfig(num_decode=2, planner=options).planner.bounds(1, 2) == (1, 1, 2, 4)


def busy() -> FakeActor:
    """A decode actor whose output stream never yields (the worker is busy): enough for a channel."""
    return FakeActor(outputs=SilentStream())


def test_removed_decode_worker_moves_its_open_requests_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """A drain past its deadline removes a worker that still streams: those attempts get Ray's "worker
    died" error (the client migrates them, as after a death), not a bare error that fails them. Found
    by the chaos soak: such requests ended in a 500 ("output channel closed"). Both channels cancel
    their worker's end (``ray.cancel``, recorded here: on a fake stream it would start a local Ray)."""
    cancelled: list[object] = []
    monkeypatch.setattr("router.channel.ray.cancel", cancelled.append)
    actors = [busy(), busy()]
    t = WorkerTable([], [DecodeHandle(a) for a in actors], 1.0)
    d0, d1 = t.decode
    d0.worker_id = "decode-0"

    async def main() -> tuple[BaseException, BaseException]:
        assert isinstance(d0.handle, DecodeHandle) and isinstance(d1.handle, DecodeHandle)
        left = d0.handle.channel.open(5)
        shut = d1.handle.channel.open(5)
        await asyncio.sleep(0)  # the readers start
        t.remove(d0)
        d1.handle.close()  # the router shutting down: a plain error is enough there
        errors = []
        for outputs in (left, shut):
            with pytest.raises(Exception) as caught:
                await outputs.next()
            errors.append(caught.value)
        return errors[0], errors[1]

    left, shut = asyncio.run(main())
    assert isinstance(left, WORKER_DIED) and "decode-0 left the cluster" in str(left), repr(left)
    assert isinstance(shut, RuntimeError) and not isinstance(shut, WORKER_DIED), repr(shut)
    assert cancelled == [a.replies["outputs"] for a in actors]

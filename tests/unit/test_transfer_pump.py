"""The NIXL progress pump's cadence: fast only while transfers are in flight, slow otherwise.

The cadence is ``ProgressPump.next_wait()`` on the pump's clock (a ``FakeClock`` here, moved by the
test past a kick's linger). The thread that follows it progresses a real UCX agent through a thin
wrapper that counts its ``get_new_notifs`` calls (each call is one progress): with an idle cadence of a
minute, any progress after the first wait is the fast cadence, or a kick waking the thread.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from tests.fakes import FakeClock
from tests.waiting import wait_until
from transfer.agent import LINGER_S as SOURCE_LINGER_S
from transfer.agent import ProgressPump, new_agent
from transfer.nixl_source import PROGRESS_INTERVAL_S, KvSource
from transfer.wire import KvLayout

FAST_S, IDLE_S, LINGER_S = 0.001, 0.05, 0.2
MINUTE = 60.0  # an idle cadence no test waits out
WAIT_S = 30.0  # bounds a hang only


class Counting:
    """Forwards to a real agent and counts progress calls."""

    def __init__(self, agent: Any) -> None:
        self.agent = agent
        self.calls = 0

    def get_new_notifs(self) -> Any:
        self.calls += 1
        return self.agent.get_new_notifs()


def pump_threads(name: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == f"nixl-progress-{name}"]


def counted_pump(name: str, idle: float, clock: FakeClock, busy: Callable[[], bool] | None = None
                 ) -> tuple[Counting, ProgressPump]:
    """A pump at the fast cadence ``FAST_S`` and ``idle``, over a real UCX agent whose progresses count."""
    counter = Counting(new_agent(f"pump-{name}", "UCX", progress_thread=False))
    return counter, ProgressPump(counter, name, FAST_S, keep_notifs=False, busy=busy, idle_interval=idle,
                                 linger=LINGER_S, clock=clock)


def test_a_kick_makes_the_cadence_fast_for_the_linger() -> None:
    clock = FakeClock()
    _, pump = counted_pump("kick", IDLE_S, clock)
    try:
        assert not pump.in_flight() and pump.next_wait() == IDLE_S
        pump.kick()
        assert pump.in_flight() and pump.next_wait() == FAST_S
        clock.advance(LINGER_S * 0.75)
        assert pump.in_flight() and pump.next_wait() == FAST_S
        clock.advance(LINGER_S * 0.5)  # the linger has passed: back to the idle cadence
        assert not pump.in_flight() and pump.next_wait() == IDLE_S
    finally:
        pump.stop()


def test_a_kick_wakes_an_idle_pump_at_once() -> None:
    clock = FakeClock()
    counter, pump = counted_pump("wake", MINUTE, clock)
    try:
        before = counter.calls  # the thread waits a minute before its first progress
        pump.kick()
        wait_until(lambda: counter.calls >= before + 10, WAIT_S, "progress at the fast cadence after a kick")
        clock.advance(LINGER_S)
        assert pump.next_wait() == MINUTE
    finally:
        pump.stop()


def test_busy_predicate_keeps_it_fast_and_stop_does_not_wait_for_the_idle_tick() -> None:
    busy = [True]
    counter, pump = counted_pump("busy", MINUTE, FakeClock(), busy=lambda: busy[0])
    assert pump.next_wait() == FAST_S
    wait_until(lambda: counter.calls >= 10, WAIT_S, "progress at the fast cadence while busy")
    busy[0] = False
    assert pump.next_wait() == MINUTE  # the thread now waits a minute between progresses
    pump.stop()  # joins the thread for up to 5 s: it must have woken, not waited out its minute
    assert pump_threads("busy") == []


def test_source_progresses_fast_exactly_while_a_lease_is_held() -> None:
    layout = KvLayout("tiny", "float32", num_layers=2, num_blocks=4, block_size=4, num_kv_heads=1,
                      head_dim=8, element_size=4)
    clock = FakeClock()
    source = KvSource(torch.zeros(layout.shape), layout, "pump-source", pump_clock=clock)
    pump = source._pump
    try:
        assert not pump.in_flight()
        source.add_lease("r1", time.time() + 30.0)
        clock.advance(SOURCE_LINGER_S * 2)  # past the kick's linger: the lease alone keeps it fast
        assert pump.in_flight() and pump.next_wait() == PROGRESS_INTERVAL_S
        assert source.end_lease("r1")
        assert not pump.in_flight()
        source.add_lease("r2", time.time() - 1.0)  # already past its deadline
        assert pump.in_flight()  # the kick's linger
        assert source.poll() == ([], ["r2"])
        clock.advance(SOURCE_LINGER_S * 2)
        assert not pump.in_flight()
    finally:
        source.close()

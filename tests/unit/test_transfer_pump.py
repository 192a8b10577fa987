"""The NIXL progress pump's cadence: fast only while transfers are in flight, slow otherwise.

A real UCX agent is progressed; a thin wrapper counts its ``get_new_notifs`` calls (each call is
one progress). At the fast cadence (1 ms) a 0.3 s window holds ~300 calls, at the idle one
(50 ms) ~6; the bounds below sit far from both so a loaded 2-core host does not flip them.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from transfer.agent import ProgressPump, new_agent
from transfer.nixl_source import KvSource
from transfer.wire import KvLayout

FAST_S, IDLE_S, LINGER_S = 0.001, 0.05, 0.2
WINDOW_S = 0.3
IDLE_MAX = 15  # calls in WINDOW_S at the idle cadence: 6 expected
FAST_MIN = 40  # ... at the fast cadence: ~300 expected


class Counting:
    """Forwards to a real agent and counts progress calls."""

    def __init__(self, agent: Any) -> None:
        self.agent = agent
        self.calls = 0

    def get_new_notifs(self) -> Any:
        self.calls += 1
        return self.agent.get_new_notifs()


def calls_in_window(counter: Counting) -> int:
    before = counter.calls
    time.sleep(WINDOW_S)
    return counter.calls - before


def test_idle_pump_is_slow_and_a_kick_makes_it_fast_for_the_linger() -> None:
    counter = Counting(new_agent("pump-kick", "UCX", progress_thread=False))
    pump = ProgressPump(counter, "kick", FAST_S, keep_notifs=False,
                        idle_interval=IDLE_S, linger=LINGER_S)
    try:
        assert not pump.in_flight()
        assert calls_in_window(counter) <= IDLE_MAX
        pump.kick()
        assert pump.in_flight()
        before = counter.calls
        time.sleep(LINGER_S * 0.75)
        assert counter.calls - before >= FAST_MIN * LINGER_S * 0.75 / WINDOW_S
        time.sleep(LINGER_S)  # the linger has passed: back to the idle cadence
        assert not pump.in_flight()
        assert calls_in_window(counter) <= IDLE_MAX
    finally:
        pump.stop()


def test_busy_predicate_keeps_it_fast_and_stop_does_not_wait_for_the_idle_tick() -> None:
    busy = [True]
    counter = Counting(new_agent("pump-busy", "UCX", progress_thread=False))
    pump = ProgressPump(counter, "busy", FAST_S, keep_notifs=False,
                        busy=lambda: busy[0], idle_interval=5.0, linger=LINGER_S)
    assert calls_in_window(counter) >= FAST_MIN
    busy[0] = False
    time.sleep(0.01)  # the thread now sleeps 5 s between progresses
    assert calls_in_window(counter) <= 2
    started = time.monotonic()
    pump.stop()
    assert time.monotonic() - started < 1.0
    stopped = counter.calls
    time.sleep(0.05)
    assert counter.calls == stopped


def test_source_progresses_fast_exactly_while_a_lease_is_held() -> None:
    layout = KvLayout("tiny", "float32", num_layers=2, num_blocks=4, block_size=4, num_kv_heads=1,
                      head_dim=8, element_size=4)
    source = KvSource(torch.zeros(layout.shape), layout, "pump-source")
    pump = source._pump
    try:
        assert not pump.in_flight()
        source.add_lease("r1", time.time() + 30.0)
        time.sleep(LINGER_S * 2)  # past the kick's linger: the lease alone keeps it fast
        assert pump.in_flight()
        assert source.end_lease("r1")
        time.sleep(LINGER_S * 2)
        assert not pump.in_flight()
        source.add_lease("r2", time.time() - 1.0)  # already past its deadline
        assert source.poll() == ([], ["r2"])
        time.sleep(LINGER_S * 2)
        assert not pump.in_flight()
    finally:
        source.close()

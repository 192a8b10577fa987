"""``pdserve profile --calibrate``'s host model: the step clocks of ``/v1/workers`` read before and
after its load, and ``host_cores`` and the contentions fitted so the simulator reproduces that load's
wall over CPU and CPU over priced steps (hand-computed cases)."""

from __future__ import annotations

import msgspec
import pytest

from messages.wire import StepStats, WorkerStats
from planner.calibrate import (
    CONTENTION_RANGE,
    HostLoad,
    HostShare,
    StepClocks,
    apply_host_load,
    fit_host_share,
    role_clocks,
)
from planner.profile import DecodeCost, PrefillCost
from planner.simulator import Cluster
from tests.unit.test_simulator import make_profile

# Two clients, each sending one (100, 5) request at 0 (the load ends before either finishes): with the
# test profile (prefill 10 ms + 1 ms a token, decode 20 ms a step, 5 ms transfer, 10 ms overhead), r1's
# prompt runs alone (0.01-0.12) and r2's (0.12-0.23) beside r1's first decode steps (from 0.125):
# tests/unit/test_simulator.py's contention cases.
LOAD = HostLoad(concurrency=2, input_len=100, output_len=5, duration_s=0.001)
LENGTHS = [(100, 5), (100, 5)]


@pytest.mark.parametrize("share", [HostShare(4 / 3, 1.5, 1.2), HostShare(0.8, 2.5, 1.0),
                                   HostShare(None, 2.0, 1.0)])
def test_fit_reproduces_the_figures_of_the_host_model_that_made_them(share: HostShare) -> None:
    sim = share.simulate(make_profile(), Cluster(1, 1), LOAD, LENGTHS)
    got = fit_host_share(make_profile(), Cluster(1, 1), LOAD, LENGTHS, wait=sim.wait_stretch,
                         decode_cpu=sim.decode_cpu_stretch, prefill_cpu=sim.prefill_cpu_stretch)
    again = got.simulate(make_profile(), Cluster(1, 1), LOAD, LENGTHS)
    assert (again.wait_stretch, again.decode_cpu_stretch, again.prefill_cpu_stretch) == pytest.approx(
        (sim.wait_stretch, sim.decode_cpu_stretch, sim.prefill_cpu_stretch), rel=1e-6)
    assert (got.host_cores is None) == (share.host_cores is None)
    if share == HostShare(4 / 3, 1.5, 1.2):
        # here the figures move with every parameter; elsewhere, on a load of two requests, a step that
        # begins beside a prompt is contended whole, and other models give the same figures
        assert (got.host_cores, got.decode_contention, got.prefill_contention) == pytest.approx(
            (4 / 3, 1.5, 1.2), rel=1e-6)


def test_figures_under_the_threshold_model_nothing_and_the_range_clamps() -> None:
    none = fit_host_share(make_profile(), Cluster(1, 1), LOAD, LENGTHS, wait=1.04, decode_cpu=1.04,
                          prefill_cpu=0.9)
    assert none == HostShare()
    # at most 3 of r1's 4 steps overlap a prompt: no contention reaches a CPU stretch of 10
    clamped = fit_host_share(make_profile(), Cluster(1, 1), LOAD, LENGTHS, wait=1.0, decode_cpu=10.0,
                             prefill_cpu=1.0)
    assert clamped.decode_contention == CONTENTION_RANGE[1]


def test_apply_host_load_fits_wait_to_wall_over_cpu_and_contention_to_cpu_over_priced() -> None:
    # decode: 7 decode-only steps priced 7 x 20 ms = 0.14 s took 0.2 s of wall and of CPU: no wait for a
    # core, CPU / priced 10 / 7, which the simulator gives with decode contention 2 (test_simulator's
    # case); prefill: 2 steps of 200 tokens in all, priced 2 x 10 ms + 200 ms, at their price
    decode = StepClocks(7, 0.2, 0.2, decode_steps=7, decode_wall_s=0.2, decode_rows=8, decode_context=900)
    prefill = StepClocks(2, 0.22, 0.22, prefill_steps=2, prefill_wall_s=0.22, prefill_tokens=200)
    prof = apply_host_load(make_profile(), Cluster(1, 1), LOAD, LENGTHS, prefill, decode)
    assert prof.host_cores is None and prof.prefill_host_cores is None
    assert prof.decode_contention == pytest.approx(2.0, rel=1e-6)
    assert prof.prefill_contention == 1.0
    assert ("wall / priced 1.43x on decode (7 steps, 8 rows; wall / CPU 1.00x), 1.00x on prefill (2 steps, "
            "200 tokens; wall / CPU 1.00x); wall / CPU pooled 1.00x: host_cores none, contention decode "
            "2.00, prefill 1.00 (simulated: wall / CPU 1.00, CPU / priced decode 1.43, prefill 1.00; "
            "stretch decode 1.43, prefill 1.00)") in prof.notes
    # the same decode wall with half of it waiting for a core (CPU 0.1 s for 0.14 s priced): no contention
    # (CPU under the price), and a wait fitted to the pooled wall / CPU (0.42 s over 0.32 s)
    waiting = StepClocks(7, 0.2, 0.1, decode_steps=7, decode_wall_s=0.2, decode_rows=8, decode_context=900)
    prof = apply_host_load(make_profile(), Cluster(1, 1), LOAD, LENGTHS, prefill, waiting)
    assert prof.decode_contention == 1.0 and prof.host_cores is not None
    sim = HostShare(prof.host_cores).simulate(make_profile(), Cluster(1, 1), LOAD, LENGTHS)
    assert sim.wait_stretch == pytest.approx(0.42 / 0.32, rel=1e-6)
    # priced with the engine's costs when given (the calibrated profile's decode base may carry the
    # serving stack's step overhead): 7 x 30 ms = 0.21 s, under the wall: nothing modelled
    engine = make_profile(decode=DecodeCost(0.03, 0.0, 0.0))
    none = apply_host_load(make_profile(), Cluster(1, 1), LOAD, LENGTHS, prefill, decode, engine=engine)
    assert none.host_cores is None and none.decode_contention == 1.0
    assert "no host sharing modelled" in none.notes


def test_stretch_is_wall_over_the_profile_price_of_the_counted_steps() -> None:
    c = StepClocks(14, 5.315, 5.0, decode_steps=10, decode_wall_s=0.915, decode_rows=25, decode_context=5000,
                   prefill_steps=4, prefill_wall_s=4.4, prefill_tokens=1000, prefill_attended=200_000.0)
    dcost, pcost = DecodeCost(0.05, 0.004, 2e-6), PrefillCost(0.08, 0.003, 1e-6)
    assert c.decode_priced_s(dcost) == pytest.approx(0.5 + 0.1 + 0.01)  # 10 steps, 25 rows, 5,000 tokens
    assert c.decode_stretch(dcost) == pytest.approx(1.5)
    assert c.prefill_priced_s(pcost) == pytest.approx(0.32 + 3.0 + 0.2)  # 4 steps, 1,000 tokens, 200k pairs
    assert c.prefill_stretch(pcost) == pytest.approx(1.25)
    assert c.cpu_stretch == pytest.approx(5.315 / 5.0)
    assert StepClocks(0, 0.0, 0.0).decode_stretch(dcost) == 1.0  # nothing stepped: no stretch


def test_decode_steps_priced_at_their_mean_batch_on_a_table() -> None:
    # 10 steps of 25 rows: mean batch 2.5, halfway between the table's 2 (80 ms) and 3 (100 ms)
    c = StepClocks(10, 1.0, 1.0, decode_steps=10, decode_wall_s=1.0, decode_rows=25, decode_context=5000)
    cost = DecodeCost(0.05, 0.004, 2e-6, ((1, 0.04), (2, 0.08), (3, 0.10)))
    assert c.decode_priced_s(cost) == pytest.approx(10 * 0.09 + 5000 * 2e-6)


def test_step_clocks_summed_per_role_between_two_reads() -> None:
    def w(worker_id: str, role: str, steps: int, wall: float, cpu: float, rows: int = 0) -> dict[str, object]:
        """A worker's /v1/workers entry, as the router writes it."""
        clock = StepStats(steps=steps, wall_s=wall, cpu_s=cpu, decode_steps=steps, decode_wall_s=wall,
                          decode_rows=rows, decode_context=100 * rows)
        entry = msgspec.json.decode(msgspec.json.encode(WorkerStats(worker_id=worker_id, role=role,
                                                                     clock=clock)))
        assert isinstance(entry, dict)
        return entry

    before = [w("p0", "prefill", 10, 1.0, 1.0), w("d0", "decode", 5, 0.5, 0.5, 9),
              w("d1", "decode", 7, 9.0, 8.0, 4)]
    after = [w("p0", "prefill", 14, 3.0, 2.0), w("d0", "decode", 25, 4.5, 3.0, 49),
             w("d1", "decode", 2, 0.3, 0.2, 1),  # restarted between the reads: left out
             w("d2", "decode", 9, 1.0, 1.0, 3)]  # joined between them: left out
    assert role_clocks(before, after, "prefill") == StepClocks(4, 2.0, 1.0, decode_steps=4, decode_wall_s=2.0)
    d = role_clocks(before, after, "decode")
    assert d == StepClocks(20, 4.0, 2.5, decode_steps=20, decode_wall_s=4.0, decode_rows=40,
                           decode_context=4000)
    assert d.cpu_stretch == pytest.approx(1.6) and isinstance(d.decode_rows, int)

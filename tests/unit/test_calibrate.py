"""``pdserve profile --calibrate``'s host-sharing figure: the step clocks of ``/v1/workers`` read
before and after its load, and ``host_cores`` fitted so the simulator stretches that load's decode steps
as much as the server did (hand-computed cases)."""

from __future__ import annotations

import pytest

from planner.calibrate import (
    HOST_CORES_RANGE,
    HostLoad,
    StepClocks,
    _clocks,
    apply_host_load,
    fit_host_cores,
    fit_host_sharing,
)
from planner.profile import DecodeCost, PrefillCost
from planner.simulator import Cluster
from tests.unit.test_simulator import make_profile

# Two clients, each sending one (100, 5) request at 0 (the load ends before either finishes). With the
# test profile (prefill 10 ms + 1 ms a token, decode 20 ms a step, 5 ms transfer, 10 ms overhead) r1's
# prompt runs alone (0.01-0.12), r2's starts at 0.12 and has 0.105 s of work left when r1 starts
# decoding at 0.125: two workers busy, each step stretched by s = 2 / host_cores (one busy worker: by
# 1 / host_cores, at least 1 either way). r1's four decode steps (0.08 s of work, 0.08 s stretched) end
# before r2's prompt does (0.105 s of work at 1/s), so r2 decodes alone: the decode stretch is
# (0.08 s + 0.08) / 0.16 = (s + 1) / 2 with host_cores >= 1, (s + s / 2) / 2 = 1.5 / host_cores below.
LOAD = HostLoad(concurrency=2, input_len=100, output_len=5, duration_s=0.001)
LENGTHS = [(100, 5), (100, 5)]


@pytest.mark.parametrize(("stretch", "host_cores"), [(1.5, 1.0), (1.25, 4 / 3), (3.0, 0.5)])
def test_host_cores_fitted_so_the_simulated_decode_stretch_matches(stretch: float, host_cores: float) -> None:
    # (s + 1) / 2 = stretch -> s = 2 stretch - 1 -> host_cores = 2 / s; under one core 1.5 / host_cores
    got = fit_host_cores(make_profile(), Cluster(1, 1), LOAD, LENGTHS, stretch)
    assert got == pytest.approx(host_cores, rel=1e-6)


def test_no_host_sharing_below_the_threshold_and_the_search_range_clamps() -> None:
    assert fit_host_cores(make_profile(), Cluster(1, 1), LOAD, LENGTHS, 1.04) is None
    # 1.5 / host_cores reaches 30 at the range's 0.05 cores: a larger stretch clamps there
    assert fit_host_cores(make_profile(), Cluster(1, 1), LOAD, LENGTHS, 40.0) == 0.05


def test_apply_host_load_fits_the_stretch_over_priced_steps_not_over_cpu() -> None:
    # decode: 8 decode-only steps priced 8 x 20 ms = 0.16 s took 0.2 s of wall: 1.25, while wall / CPU is
    # 1.0 (the stretch wall / CPU cannot see). With 4 / 3 cores for both roles (the case above) the
    # prompt r2 runs 0.12-0.125 alone, then 0.12 s at 2 / (4 / 3) = 1.5x (0.08 s of work) while r1
    # decodes, then its last 0.025 s alone: prefill busy 0.01-0.27 for 0.22 s of work, 13 / 11. So
    # prefill steps measured at 13 / 11 (3 steps of 200 tokens in all, priced 3 x 10 ms + 200 ms) fit
    # both figures at 4 / 3.
    decode = StepClocks(8, 0.2, 0.2, decode_steps=8, decode_wall_s=0.2, decode_rows=12, decode_context=900)
    prefill = StepClocks(3, 0.3, 0.25, prefill_steps=3, prefill_wall_s=0.23 * 13 / 11, prefill_tokens=200)
    prof = apply_host_load(make_profile(), Cluster(1, 1), LOAD, LENGTHS, prefill, decode)
    assert prof.host_cores == pytest.approx(4 / 3, rel=1e-6)
    assert prof.prefill_host_cores == pytest.approx(4 / 3, rel=1e-6)
    assert ("wall / priced 1.25x on decode (8 steps, 12 rows; wall / CPU 1.00x), 1.18x on prefill "
            "(3 steps, 200 tokens; wall / CPU 1.20x)") in prof.notes
    assert ("host_cores 1.33, prefill_host_cores 1.33 (simulated stretch: decode 1.25, prefill 1.18)"
            in prof.notes)
    # priced with the engine's costs when given (the calibrated profile's decode base may carry the
    # serving stack's step overhead): 8 x 25 ms = 0.2 s, no stretch
    engine = make_profile(decode=DecodeCost(0.025, 0.0, 0.0))
    none = apply_host_load(make_profile(), Cluster(1, 1), LOAD, LENGTHS, prefill, decode, engine=engine)
    assert none.host_cores is None and none.prefill_host_cores is None
    assert "no host sharing modelled" in none.notes


def test_prefill_steps_that_did_not_stretch_get_a_figure_that_never_stretches_them() -> None:
    # prefill at its price (1.0), decode at 10 / 7: test_simulator's case of 1 core for decode steps and
    # none shared by prefill steps (its prompt at full speed, three of r1's steps stretched 2x, then
    # four alone: 0.20 s for 0.14 s of work)
    decode = StepClocks(7, 0.2, 0.2, decode_steps=7, decode_wall_s=0.2, decode_rows=8, decode_context=900)
    prefill = StepClocks(2, 0.22, 0.22, prefill_steps=2, prefill_wall_s=0.22, prefill_tokens=200)
    host_cores, prefill_cores = fit_host_sharing(make_profile(), Cluster(1, 1), LOAD, LENGTHS,
                                                 decode.decode_stretch(make_profile().decode),
                                                 prefill.prefill_stretch(make_profile().prefill))
    assert prefill_cores == HOST_CORES_RANGE[1]
    assert host_cores == pytest.approx(1.0, rel=1e-6)


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


def test_step_clocks_summed_per_role_between_two_reads() -> None:
    def w(worker_id: str, role: str, steps: int, wall: float, cpu: float, rows: int = 0) -> dict[str, object]:
        return {"worker_id": worker_id, "role": role, "step_count": steps, "step_wall_seconds": wall,
                "step_cpu_seconds": cpu, "step_decode_count": steps, "step_decode_wall_seconds": wall,
                "step_decode_rows": rows, "step_decode_context_tokens": 100 * rows,
                "step_prefill_count": 0, "step_prefill_wall_seconds": 0.0, "step_prefill_tokens": 0,
                "step_prefill_attended_pairs": 0.0}

    before = [w("p0", "prefill", 10, 1.0, 1.0), w("d0", "decode", 5, 0.5, 0.5, 9),
              w("d1", "decode", 7, 9.0, 8.0, 4)]
    after = [w("p0", "prefill", 14, 3.0, 2.0), w("d0", "decode", 25, 4.5, 3.0, 49),
             w("d1", "decode", 2, 0.3, 0.2, 1),  # restarted between the reads: left out
             w("d2", "decode", 9, 1.0, 1.0, 3)]  # joined between them: left out
    assert _clocks(before, after, "prefill") == StepClocks(4, 2.0, 1.0, decode_steps=4, decode_wall_s=2.0)
    d = _clocks(before, after, "decode")
    assert d == StepClocks(20, 4.0, 2.5, decode_steps=20, decode_wall_s=4.0, decode_rows=40,
                           decode_context=4000)
    assert d.cpu_stretch == pytest.approx(1.6) and isinstance(d.decode_rows, int)

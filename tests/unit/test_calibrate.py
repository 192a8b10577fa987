"""``pdserve profile --calibrate``'s host-sharing figure: the step clocks of ``/v1/workers`` read
before and after its load, and ``host_cores`` fitted so the simulator stretches that load's decode steps
as much as the server did (hand-computed cases)."""

from __future__ import annotations

import pytest

from planner.calibrate import HostLoad, StepClocks, _clocks, apply_host_load, fit_host_cores
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


def test_apply_host_load_sets_host_cores_and_says_what_it_measured() -> None:
    prof = apply_host_load(make_profile(), Cluster(1, 1), LOAD, LENGTHS, StepClocks(30, 3.0, 2.0),
                           StepClocks(8, 2.5, 2.0))
    assert prof.host_cores == pytest.approx(4 / 3, rel=1e-6)  # decode 2.5 / 2.0 = 1.25, as above
    assert "wall / CPU 1.25x on decode (8 steps), 1.50x on prefill (30 steps)" in prof.notes
    assert "host_cores 1.33 (simulated stretch: decode 1.25" in prof.notes
    none = apply_host_load(make_profile(), Cluster(1, 1), LOAD, LENGTHS, StepClocks(3, 1.0, 1.0),
                           StepClocks(8, 1.0, 1.0))
    assert none.host_cores is None and "no host sharing modelled" in none.notes


def test_step_clocks_summed_per_role_between_two_reads() -> None:
    def w(worker_id: str, role: str, steps: int, wall: float, cpu: float) -> dict[str, object]:
        return {"worker_id": worker_id, "role": role, "step_count": steps, "step_wall_seconds": wall,
                "step_cpu_seconds": cpu}

    before = [w("p0", "prefill", 10, 1.0, 1.0), w("d0", "decode", 5, 0.5, 0.5),
              w("d1", "decode", 7, 9.0, 8.0)]
    after = [w("p0", "prefill", 14, 3.0, 2.0), w("d0", "decode", 25, 4.5, 3.0),
             w("d1", "decode", 2, 0.3, 0.2),  # restarted between the reads: left out
             w("d2", "decode", 9, 1.0, 1.0)]  # joined between them: left out
    assert _clocks(before, after, "prefill") == StepClocks(4, 2.0, 1.0)
    d = _clocks(before, after, "decode")
    assert d == StepClocks(20, 4.0, 2.5) and d.stretch == pytest.approx(1.6)

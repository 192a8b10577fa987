"""The simulator on cases small enough to compute by hand: exact TTFTs, ITLs and end times."""

from __future__ import annotations

import numpy as np
import pytest

from planner.profile import (
    DecodeCost,
    MachineInfo,
    ModelInfo,
    PrefillCost,
    Profile,
    TransferCost,
)
from planner.results import Percentiles, SimResult, weighted_percentile
from planner.sim_workers import DecodeSim, PrefillSim, PrefixLru, Req
from planner.simulator import Cluster, RequestSpec, Simulation, _Role, simulate
from router.policy import Candidate, PrefixAware

EXACT = 1e-12


def make_profile(*, prefill: PrefillCost | None = None, decode: DecodeCost | None = None,
                 transfer: TransferCost | None = None, overhead: float = 0.01, budget: int = 2048,
                 kv_tokens: int = 100_000, max_seqs: int = 128) -> Profile:
    """Prefill 10 ms + 1 ms/token, decode 20 ms a step, transfer 5 ms flat, 10 ms overhead."""
    return Profile(
        machine=MachineInfo("test", "test", "test", 1, "cpu", 1),
        model=ModelInfo("m", "float32", "auto", 1000, 16, kv_tokens, budget, max_seqs),
        prefill=prefill or PrefillCost(0.01, 0.001, 0.0),
        decode=decode or DecodeCost(0.02, 0.0, 0.0),
        transfer=transfer or TransferCost(0.005, 1e30),
        request_overhead_s=overhead,
    )


def run(profile: Profile, specs: list[RequestSpec], p: int = 1, d: int = 1) -> Simulation:
    sim = Simulation(profile, Cluster(p, d), specs)
    sim.run()
    return sim


def test_one_request_exact_ttft_itl_and_end() -> None:
    # overhead 0.01; prefill 0.01 + 100 x 0.001 = 0.11; transfer 0.005; then 4 decode steps of 0.02
    sim = run(make_profile(), [RequestSpec(100, 5)])
    (r,) = sim.reqs
    assert r.first == pytest.approx(0.125, abs=EXACT)
    assert r.end == pytest.approx(0.205, abs=EXACT)
    res = sim._result(0.0)
    assert res.ttft.p50 == pytest.approx(0.125, abs=EXACT)
    assert res.itl.p50 == pytest.approx(0.02, abs=EXACT) and res.itl.p99 == pytest.approx(0.02, abs=EXACT)
    assert res.e2e.p90 == pytest.approx(0.205, abs=EXACT)
    assert res.completed == res.requests == 1
    assert res.request_throughput == pytest.approx(1 / 0.205)
    assert res.output_throughput == pytest.approx(5 / 0.205)
    assert res.prefill_utilisation == pytest.approx(0.11 / 0.205)
    assert res.decode_utilisation == pytest.approx(0.08 / 0.205)


def test_one_output_token_finishes_at_its_first_token() -> None:
    sim = run(make_profile(), [RequestSpec(100, 1)])
    assert sim.reqs[0].first == sim.reqs[0].end == pytest.approx(0.125, abs=EXACT)


def test_queued_requests_wait_and_long_prompts_run_in_chunks() -> None:
    # budget 128. r1 (300 tokens) starts alone at 0.01 (r2 is queued behind a running step): 128 tokens
    # (0.138, to 0.148), 128 more (to 0.286), then its last 44 beside r2's first 84 (to 0.424); r2's last 16
    # take 0.026 (to 0.450). Each KV lands 5 ms later, on an idle decode worker.
    sim = run(make_profile(budget=128), [RequestSpec(300, 2), RequestSpec(100, 2)])
    r1, r2 = sim.reqs
    assert r1.first == pytest.approx(0.429, abs=EXACT)
    assert r1.end == pytest.approx(0.449, abs=EXACT)
    assert r2.first == pytest.approx(0.455, abs=EXACT)
    assert r2.end == pytest.approx(0.475, abs=EXACT)


def test_a_request_joins_the_running_batch_at_the_next_step_boundary() -> None:
    # r1's prompt runs 0.01 -> 0.12, r2's 0.12 -> 0.23. r1 decodes 10 steps from 0.125; r2's KV lands at
    # 0.235, in r1's step 0.225 -> 0.245, so its first token comes at 0.245 and it decodes beside r1 from
    # there.
    sim = run(make_profile(), [RequestSpec(100, 11), RequestSpec(100, 5)])
    r1, r2 = sim.reqs
    assert r1.first == pytest.approx(0.125, abs=EXACT)
    assert r2.first == pytest.approx(0.245, abs=EXACT)
    assert r1.end == pytest.approx(0.325, abs=EXACT)
    assert r2.end == pytest.approx(0.325, abs=EXACT)
    res = sim._result(0.0)
    assert res.itl.p50 == pytest.approx(0.02, abs=EXACT)
    assert res.mean_decode_batch == pytest.approx(1.4)  # 6 steps of r1 alone, then 4 of both


def test_decode_steps_grow_with_context_as_an_arithmetic_series() -> None:
    # 0.02 + 1e-4 x context: the request joins with 101 tokens, so its 3 steps take 0.0301, 0.0302, 0.0303
    sim = run(make_profile(decode=DecodeCost(0.02, 0.0, 1e-4)), [RequestSpec(100, 4)])
    (r,) = sim.reqs
    assert r.first == pytest.approx(0.125, abs=EXACT)
    assert r.end - r.first == pytest.approx(0.0906, abs=EXACT)
    res = sim._result(0.0)
    assert res.itl.p50 == pytest.approx(0.0302, abs=EXACT)
    assert res.itl.mean == pytest.approx(0.0302, abs=EXACT)


def test_segment_cut_finds_the_step_running() -> None:
    d = DecodeSim(0, DecodeCost(0.02, 0.0, 1e-4), 8, 10_000, PrefixLru(100))
    d.batch, d.context, d.step = 2, 200, 0
    d.finishing = [(9, 0, None)]  # type: ignore[list-item]
    end = d.start_segment(1.0)  # steps of 0.04, 0.0402, 0.0404, ...: 10 steps
    assert end == pytest.approx(1.0 + 10 * 0.04 + 0.0002 * 45, abs=EXACT)
    assert d.steps_until(1.0401) == 2  # the second step runs 1.04 -> 1.0802
    assert d.steps_until(1.0399) == 1
    assert d.cut(1.0401) == pytest.approx(1.0802, abs=EXACT)
    assert d.cut(1.05) is None  # the segment already ends with that step


def test_prefix_hit_skips_the_cached_blocks_and_the_transfer_skips_what_decode_holds() -> None:
    # both share a 64-token prefix (4 blocks); r2 arrives after r1 is done: prefill computes 100 - 64 = 36
    # tokens (0.01 + 0.036), the decode worker holds the prefix so it pulls 3 of 7 blocks
    prof = make_profile(transfer=TransferCost(0.005, 1000 * 16 / 0.001))  # 1 ms per block
    sim = run(prof, [RequestSpec(100, 2, 0.0, 7, 64), RequestSpec(100, 2, 1.0, 7, 64)])
    r1, r2 = sim.reqs
    assert r1.cached == 0 and r2.cached == 64
    assert r1.first == pytest.approx(0.01 + 0.11 + 0.005 + 0.007, abs=EXACT)
    assert r2.first - r2.arrival == pytest.approx(0.01 + 0.046 + 0.005 + 0.003, abs=EXACT)


def test_router_spreads_requests_over_the_least_loaded_workers() -> None:
    sim = run(make_profile(), [RequestSpec(100, 5) for _ in range(4)], p=2, d=2)
    assert [r.prefill.index for r in sim.reqs] == [0, 1, 0, 1]  # type: ignore[union-attr]
    assert [r.decode.index for r in sim.reqs] == [0, 1, 0, 1]  # type: ignore[union-attr]


def test_router_prefers_the_worker_holding_the_prefix() -> None:
    specs = [RequestSpec(200, 2, 0.0, 3, 160), RequestSpec(100, 2, 0.0), RequestSpec(200, 2, 0.001, 3, 160)]
    sim = run(make_profile(), specs, p=2, d=2)
    r1, r2, r3 = sim.reqs
    assert r1.prefill is r3.prefill and r1.decode is r3.decode  # its prefix is pending there
    assert r2.prefill is not r1.prefill


def test_kv_capacity_holds_a_request_back_until_another_finishes() -> None:
    # room for one request of 100 + 11 tokens at a time: r2 waits for r1's end (0.325) to start decoding
    sim = run(make_profile(kv_tokens=150), [RequestSpec(100, 11), RequestSpec(100, 5)])
    r1, r2 = sim.reqs
    assert r2.first == pytest.approx(0.245, abs=EXACT)  # its first token is sent at the boundary
    assert r1.end == pytest.approx(0.325, abs=EXACT)
    assert r2.end == pytest.approx(0.405, abs=EXACT)


def test_closed_loop_sends_the_next_request_when_one_ends() -> None:
    prof = make_profile()
    res = simulate(prof, Cluster(1, 1), iter([RequestSpec(100, 5)] * 100), concurrency=1, duration_s=0.5)
    # each request takes 0.205 s from send to end: sent at 0, 0.205, 0.41 (< 0.5), then no more
    assert res.requests == res.completed == 3
    assert res.duration_s == pytest.approx(0.615, abs=EXACT)


def test_unfinished_requests_count_with_infinite_ttft() -> None:
    res = simulate(make_profile(), Cluster(1, 1), [RequestSpec(1000, 2) for _ in range(5)], time_limit_s=2.5)
    assert res.completed < res.requests
    assert res.ttft.p99 == float("inf")
    assert not res.meets(100.0, 100.0)


def test_weighted_percentile_equals_the_expanded_percentile() -> None:
    rng = np.random.default_rng(0)
    values = rng.random(30)
    weights = rng.integers(1, 6, 30)
    expanded = np.repeat(values, weights)
    for q in (0, 10, 50, 90, 99, 100):
        assert weighted_percentile(values, weights.astype(float), q) == pytest.approx(
            float(np.percentile(expanded, q)), abs=EXACT)
    w = Percentiles.weighted(values, weights.astype(float))
    assert w.mean == pytest.approx(float(expanded.mean()))


def test_cluster_needs_a_worker_of_each_role() -> None:
    with pytest.raises(ValueError, match="1 prefill and >= 1 decode"):
        Cluster(0, 1)


def test_workers_sharing_one_core_run_at_half_speed_while_both_are_busy() -> None:
    # r1's prompt runs alone at full speed (0.01 -> 0.12); r2's starts then, and at 0.125 r1 starts decoding:
    # two busy workers on one core, so r1's steps take 0.04 (4 steps, to 0.285) and r2's prompt, 0.105 s of
    # work left, goes at half speed until 0.285, then its last 0.025 s at full speed (to 0.31); r2 decodes
    # alone from 0.315.
    sim = Simulation(make_profile(), Cluster(1, 1), [RequestSpec(100, 5), RequestSpec(100, 5)], host_cores=1)
    sim.run()
    r1, r2 = sim.reqs
    assert r1.first == pytest.approx(0.125, abs=EXACT)
    assert r1.end == pytest.approx(0.285, abs=EXACT)
    assert r2.first == pytest.approx(0.315, abs=EXACT)
    assert r2.end == pytest.approx(0.395, abs=EXACT)
    # the stretches: decode ran 0.16 s of stretched steps and 0.08 alone for 0.16 s of work; prefill
    # 0.30 s (0.01-0.31) for 0.22 s of work
    res = sim._result(0.0)
    assert res.decode_stretch == pytest.approx(0.24 / 0.16, abs=EXACT)
    assert res.prefill_stretch == pytest.approx(0.30 / 0.22, abs=EXACT)
    alone = run(make_profile(), [RequestSpec(100, 5), RequestSpec(100, 5)])
    assert alone.reqs[1].end == pytest.approx(0.315, abs=EXACT)  # each worker on its own core
    assert alone._result(0.0).decode_stretch == pytest.approx(1.0, abs=EXACT)
    assert alone._result(0.0).prefill_stretch == pytest.approx(1.0, abs=EXACT)


def _decode_stretched_beside_the_second_prompt(host_cores: float | None = None,
                                               prefill_host_cores: float | None = None,
                                               decode_contention: float = 1.0) -> SimResult:
    """Two (100, 5) requests where r1's decode steps take 0.04 (twice their cost) while r2's prompt runs
    at full speed (0.12-0.23): r1's first three steps (0.125, 0.165, 0.205; the third began while the
    prompt ran), then r2 joins at 0.245 and both decode alone, r1 to 0.265 and r2 to 0.325. Decode:
    0.20 s of wall for 0.14 s of work; prefill unstretched. Checks that, and returns the result."""
    sim = Simulation(make_profile(), Cluster(1, 1), [RequestSpec(100, 5), RequestSpec(100, 5)],
                     host_cores=host_cores, prefill_host_cores=prefill_host_cores,
                     decode_contention=decode_contention)
    sim.run()
    r1, r2 = sim.reqs
    assert (r1.first, r1.end) == (pytest.approx(0.125, abs=EXACT), pytest.approx(0.265, abs=EXACT))
    assert (r2.first, r2.end) == (pytest.approx(0.245, abs=EXACT), pytest.approx(0.325, abs=EXACT))
    res = sim._result(0.0)
    assert res.decode_stretch == pytest.approx(0.20 / 0.14, abs=EXACT)
    assert res.prefill_stretch == pytest.approx(1.0, abs=EXACT)
    return res


def test_contention_stretches_a_roles_steps_while_the_other_role_computes() -> None:
    # no wait for a core; a decode step takes 2x its cost while the prefill worker computes: all of the
    # decode stretch is CPU, nothing waits for a core
    res = _decode_stretched_beside_the_second_prompt(decode_contention=2.0)
    assert res.decode_cpu_stretch == pytest.approx(0.20 / 0.14, abs=EXACT)
    assert (res.prefill_cpu_stretch, res.wait_stretch) == pytest.approx((1, 1), abs=EXACT)
    specs = [RequestSpec(100, 5), RequestSpec(100, 5)]

    # both terms, one core: r1's steps take 0.02 x 2 (two busy workers on one core) x 2 (contention) =
    # 0.08 (0.125 -> 0.205, 0.285, 0.365); r2's prompt, 0.105 s of work left at 0.125, runs at half speed
    # and ends at 0.335, within r1's third step; r2 is pulled at 0.34 and joins at 0.365; r1's last step
    # and r2's four run alone (r1 ends 0.385, r2 0.445). Decode: 0.32 s of wall, 0.20 s of CPU (0.06 s of
    # work doubled, 0.08 alone), 0.14 s of work; prefill: 0.11 + 0.215 s of wall for 0.22 s of work and CPU.
    both = Simulation(make_profile(), Cluster(1, 1), specs, host_cores=1, decode_contention=2.0)
    both.run()
    r1, r2 = both.reqs
    assert (r1.end, r2.first, r2.end) == (pytest.approx(0.385, abs=EXACT), pytest.approx(0.365, abs=EXACT),
                                          pytest.approx(0.445, abs=EXACT))
    res = both._result(0.0)
    assert res.decode_stretch == pytest.approx(0.32 / 0.14, abs=EXACT)
    assert res.decode_cpu_stretch == pytest.approx(0.20 / 0.14, abs=EXACT)
    assert res.prefill_stretch == pytest.approx(0.325 / 0.22, abs=EXACT)
    assert res.prefill_cpu_stretch == pytest.approx(1.0, abs=EXACT)
    assert res.wait_stretch == pytest.approx((0.325 + 0.32) / (0.22 + 0.20), abs=EXACT)


def test_decode_steps_beside_decode_steps_are_not_contended() -> None:
    # two decode workers, each with one request, while no prompt runs: contention is what a prompt's
    # products do to a decode step, so neither stretches. r1's prompt 0.01-0.12, r2's 0.12-0.23 (both
    # alone: the prefill worker is the only one busy until r1 decodes at 0.125, and prefill contention is
    # 1); r2 reaches the other decode worker at 0.235, after the prompt: from then on its steps and r1's
    # overlap with no prefill busy and run at their cost.
    specs = [RequestSpec(100, 20), RequestSpec(100, 20)]
    sim = Simulation(make_profile(), Cluster(1, 2), specs, decode_contention=3.0)
    sim.run()
    r1, r2 = sim.reqs
    assert r1.decode is not r2.decode
    assert r2.first == pytest.approx(0.235, abs=EXACT)
    assert r2.end == pytest.approx(0.235 + 19 * 0.02, abs=EXACT)  # 19 steps, none contended


def test_prefill_steps_stretch_by_their_own_host_cores() -> None:
    # prefill steps see 2 cores (never stretched with 2 busy workers), decode steps 1: two busy workers
    # on one core stretch r1's steps 2x while r2's prompt runs at full speed, all of it waiting for a core
    res = _decode_stretched_beside_the_second_prompt(host_cores=1, prefill_host_cores=2)
    assert res.decode_cpu_stretch == pytest.approx(1.0, abs=EXACT)
    specs = [RequestSpec(100, 5), RequestSpec(100, 5)]
    # without its own figure prefill steps take host_cores' (the test above)
    same = Simulation(make_profile(), Cluster(1, 1), specs, host_cores=1, prefill_host_cores=None)
    same.run()
    assert same.reqs[1].end == pytest.approx(0.395, abs=EXACT)


def test_the_simulated_router_picks_what_the_routing_policy_picks() -> None:
    """The simulator and ``router/policy.py`` weigh a held prefix with one function
    (``engine/hashing.py:prefix_cost``): for the same loads, cached prefixes and requests in flight, the
    simulated router picks the worker the prefix-aware policy picks (at its default weights)."""
    rng = np.random.default_rng(0)
    block = 16
    for _ in range(300):
        workers = [PrefillSim(i, PrefillCost(0.01, 0.001, 0.0), 2048, 128, PrefixLru(100_000))
                   for i in range(4)]
        role = _Role(workers)
        for w in workers:
            role.charge(w, int(rng.integers(0, 600)))
        req = Req(0.0, int(rng.integers(20, 300)), 5, 7, int(rng.integers(0, 300)))
        hit = req.hit_tokens(block)
        cached = {i for i in range(4) if rng.random() < 0.4}
        inflight = {i for i in range(4) if rng.random() < 0.3}
        for i in cached:
            role.cached(workers[i], 7, req.prefix_tokens)
        for i in inflight:
            role.hold(workers[i], 7, +1)
        chosen, held = role.pick(req, block)
        rows = [Candidate(w.index, f"p{w.index}", hit if w.index in cached | inflight else 0, w.load,
                          free_blocks=10_000,
                          shared_load_tokens=min(hit, w.load) if w.index in inflight else 0)
                for w in workers]
        want, _ = PrefixAware().pick("prefill", rows, req.n_in, 0)
        assert chosen.index == want.index, (rows, req.n_in)
        assert held == want.prefix_tokens

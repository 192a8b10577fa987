"""Profile files, the fits, workloads by length, traces, and `pdserve profile` / `pdserve simulate`."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from cli.main import main
from engine.config import EngineConfig
from planner.calibrate import apply_calibration
from planner.fit import fit_decode, fit_prefill, fit_transfer, nonnegative_lstsq
from planner.profile import (
    DecodeCost,
    DecodeSample,
    ModelInfo,
    PrefillSample,
    Profile,
    TransferSample,
    load_profile,
    save_profile,
)
from planner.profiler import Grid, run_profile
from planner.workload import bench_requests, read_trace
from tests.unit.test_simulator import make_profile


def test_profile_round_trips_and_names_what_is_wrong(tmp_path: Path) -> None:
    prof = dataclasses.replace(make_profile(decode=DecodeCost(0.02, 0.001, 1e-6, ((1, 0.02), (4, 0.05)))),
                               prefill_samples=(PrefillSample(16, 0, 0.5),), notes="x")
    path = tmp_path / "p.json"
    save_profile(prof, path)
    assert load_profile(path) == prof
    data = json.loads(path.read_text())
    assert data["version"] == 1 and data["machine"]["device"] == "cpu" and data["model"]["name"] == "m"

    data["version"] = 2
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="profile version 2 is not supported"):
        load_profile(path)
    data["version"] = 1
    data["decode"]["per_seq_s"] = -1.0
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"decode.per_seq_s must be"):
        load_profile(path)
    data["decode"]["per_seq_s"] = 0.0
    del data["transfer"]
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="transfer"):
        load_profile(path)
    with pytest.raises(FileNotFoundError):
        load_profile(tmp_path / "missing.json")


def test_fits_recover_exact_linear_costs() -> None:
    pre = [PrefillSample(n, c, 0.01 + 0.001 * n + 1e-7 * n * (c + (n + 1) / 2))
           for n, c in ((16, 0), (64, 0), (256, 0), (512, 0), (64, 512), (256, 256))]
    fit = fit_prefill(pre)
    assert (fit.base_s, fit.per_token_s, fit.per_attended_s) == pytest.approx((0.01, 0.001, 1e-7), rel=1e-6)
    dec = [DecodeSample(b, c, 0.02 + 0.001 * b + 2e-6 * c)
           for b, c in ((1, 100), (8, 1000), (32, 4000), (8, 4000))]
    d = fit_decode(dec)
    assert (d.base_s, d.per_seq_s, d.per_context_s) == pytest.approx((0.02, 0.001, 2e-6), rel=1e-6)
    t = fit_transfer([TransferSample(b, 0.001 + b / 2e9) for b in (1 << 10, 1 << 20, 1 << 24)])
    assert (t.base_s, t.bytes_per_s) == pytest.approx((0.001, 2e9), rel=1e-6)


def test_decode_fit_keeps_a_cost_per_batch_size_where_a_line_cannot_follow_it() -> None:
    # torch's default product at these sizes: a batch of 2 costs twice a batch of 1, then it flattens
    table = {1: 0.04, 2: 0.08, 4: 0.10, 8: 0.11}
    dec = [DecodeSample(b, c, table[b] + 2e-6 * c)
           for b, c in ((1, 100), (2, 300), (4, 400), (8, 200), (8, 3000))]
    d = fit_decode(dec)
    assert d.per_context_s == pytest.approx(2e-6, rel=1e-6)
    assert [b for b, _ in d.by_batch] == [1, 2, 4, 8]
    assert [t for _, t in d.by_batch] == pytest.approx(list(table.values()), rel=1e-6)
    assert d.step_s(3, 1000) == pytest.approx(0.09 + 0.002, rel=1e-6)  # halfway between 2 and 4
    assert d.step_s(16, 0) == pytest.approx(0.11 + 8 * 0.01 / 4, rel=1e-6)  # on along the last segment
    assert d.step_s(1, 0) == pytest.approx(0.04, rel=1e-6)
    line = DecodeCost(d.base_s, d.per_seq_s, d.per_context_s)  # the straight line misses batch 2 by 20%+
    assert abs(line.step_s(2, 0) - 0.08) > 0.2 * 0.08
    # no batch size at two context sizes: the per-token cost comes from the straight line, and the
    # table still gives every measured step its time
    samples = [DecodeSample(b, 100 * b, table[b] + 2e-6 * 100 * b) for b in table]
    d2 = fit_decode(samples)
    got = [d2.step_s(s.batch, s.context_tokens) for s in samples]
    assert got == pytest.approx([s.seconds for s in samples])
    with pytest.raises(ValueError, match="ascending"):
        DecodeCost(0.01, 0.0, 0.0, ((2, 0.02), (1, 0.01)))
    with pytest.raises(ValueError, match="2 or more"):
        DecodeCost(0.01, 0.0, 0.0, ((1, 0.01),))


def test_decode_fit_at_one_batch_size_folds_the_per_request_cost_into_the_base() -> None:
    # an engine with max_num_seqs 1 runs batch 1 only: base and per-request cost cannot be told apart
    dec = [DecodeSample(1, c, 0.021 + 2e-6 * c) for c in (128, 512, 1024)]
    d = fit_decode(dec)
    assert (d.base_s, d.per_seq_s, d.per_context_s) == pytest.approx((0.021, 0.0, 2e-6), rel=1e-6)
    with pytest.raises(ValueError, match="2 context sizes"):
        fit_decode([DecodeSample(1, 128, 0.02), DecodeSample(1, 128, 0.021)])


def test_nonnegative_lstsq_fixes_a_negative_column_at_zero() -> None:
    a = np.array([[1.0, 1.0], [1.0, 2.0], [1.0, 3.0]])
    y = np.array([3.0, 2.0, 1.0])  # falling: the slope would be negative
    x = nonnegative_lstsq(a, y)
    assert x[1] == 0.0 and x[0] == pytest.approx(2.0)


MODEL = ModelInfo("m", "float32", "auto", 1000, 16, 100_000, 2048, 128, chat_user_tokens=30,
                  chat_system_tokens=10, chat_shared_tokens=20)


def test_bench_workloads_by_length() -> None:
    rnd = list(bench_requests("random", {"input_len": 100}, MODEL, rate=2.0, num_requests=5))
    assert [(s.input_tokens, s.output_tokens, s.prefix_id) for s in rnd] == [(100, 64, -1)] * 5
    assert rnd[0].arrival_s == 0.0
    assert all(a.arrival_s < b.arrival_s for a, b in zip(rnd, rnd[1:], strict=False))
    shared = list(bench_requests("shared-prefix", {"num_prefixes": 2, "questions_per_prefix": 3}, MODEL,
                                 rate=1.0, num_requests=6))
    assert sorted(s.prefix_id for s in shared) == [2, 2, 2, 3, 3, 3]  # one shuffled round
    assert {(s.input_tokens, s.prefix_tokens, s.output_tokens) for s in shared} == {(10 + 512 + 32, 512, 32)}
    mixed = list(bench_requests("mixed", {}, MODEL, rate=1.0, num_requests=400))
    rag = [s for s in mixed if s.prefix_id == 1]
    chat = [s for s in mixed if s.prefix_id == 0]
    assert len(rag) + len(chat) == 400 and 40 < len(rag) < 120  # rag_share 0.2
    assert all(10 + 64 + 768 + 16 + 1 <= s.input_tokens <= 10 + 64 + 1536 + 128 + 1 for s in rag)
    assert all(30 + 16 <= s.input_tokens <= 30 + 128 and s.prefix_tokens == 20 for s in chat)
    long = next(iter(bench_requests("long-context", {}, MODEL)))
    assert (long.input_tokens, long.output_tokens) == (2048 - 32 - 64, 32)
    with pytest.raises(ValueError, match="multi-turn.*not modelled"):
        bench_requests("multi-turn", {}, MODEL)
    with pytest.raises(ValueError, match="has no parameter"):
        bench_requests("random", {"nope": 1}, MODEL)


def test_trace_file(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    path.write_text("arrival_s,input_tokens,output_tokens,prefix_id\n0.5,100,10,3\n0.1,40,5,3\n0.2,50,5,\n")
    specs = read_trace(path)
    assert [(s.arrival_s, s.input_tokens, s.prefix_id, s.prefix_tokens) for s in specs] == [
        (0.1, 40, 3, 39), (0.2, 50, -1, 0), (0.5, 100, 3, 39)]
    path.write_text("arrival_s,input_tokens,output_tokens,prefix_id,prefix_tokens\n0,100,10,1,64\n0,9,x,1,2\n")
    with pytest.raises(ValueError, match=r"t.csv:3: expected numbers"):
        read_trace(path)
    path.write_text("arrival,input_tokens\n")
    with pytest.raises(ValueError, match="missing column"):
        read_trace(path)


def test_simulate_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prof = tmp_path / "p.json"
    save_profile(make_profile(), prof)
    out = tmp_path / "out.json"
    lengths = ["--workload", "random", "--param", "input_len=100,output_len=5"]
    assert main(["simulate", "--profile", str(prof), *lengths,
                 "--rate", "1", "--duration", "3", "--num-prefill", "1", "--num-decode", "2",
                 "--slo", "ttft=1s,itl=50ms", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "1P:2D: 3/3 requests done" in text and "TTFT ms" in text and "SLO attainment 100.0%" in text
    saved = json.loads(out.read_text())
    assert saved["result"]["ttft"]["p50"] == pytest.approx(0.125)  # an idle cluster: no queueing
    assert main(["simulate", "--profile", str(prof), *lengths, "--rate", "30", "--duration", "5",
                 "--slo", "ttft=1s,itl=50ms", "--search", "--max-prefill", "8", "--max-decode", "4"]) == 0
    text = capsys.readouterr().out
    # 30 req/s x 0.1 s of prompt work each, plus 10 ms per step shared by the prompts batched in it: three
    # prefill workers carry the 5 s of load within a TTFT p90 of 1 s, two cannot; one decode worker has room
    assert "smallest cluster meeting the SLO: 3 prefill + 1 decode = 4 workers" in text
    assert main(["simulate", "--profile", str(prof), "--search", "--rate", "1"]) == 2
    assert "--slo: --search and --max-rate need" in capsys.readouterr().err
    assert main(["simulate", "--profile", str(tmp_path / "none.json"), "--rate", "1"]) == 2
    assert "none.json" in capsys.readouterr().err


@pytest.mark.slow
def test_profile_measures_a_real_engine_and_a_nixl_read(tiny_model_dir: Path, tmp_path: Path) -> None:
    grid = Grid(prefill=((8, 0), (32, 0), (64, 0), (16, 32)), decode=((1, 16), (4, 16), (4, 64)),
                transfer_blocks=(1, 64, 1024), repeats=3, steps=3)
    # 1024 blocks of the tiny model are 8 MiB, and each size is the median of 3 reads: a lone read of a few
    # KiB took 4-7 ms now and then, more than the 8 MiB one, and hid the cost per byte
    prof = run_profile(str(tiny_model_dir), EngineConfig(num_kv_blocks=64), quick=True, torch_threads=1,
                       grid=grid)
    assert [(s.new_tokens, s.cached_tokens) for s in prof.prefill_samples] == list(grid.prefill)
    assert [s.batch for s in prof.decode_samples] == [1, 4, 4]
    assert all(s.seconds > 0 for s in prof.prefill_samples)
    assert all(s.seconds > 0 for s in prof.decode_samples)
    assert all(s.seconds > 0 for s in prof.transfer_samples)
    cfg = prof.model
    assert cfg.block_size == 16 and cfg.kv_capacity_tokens == 64 * 16
    assert prof.transfer_samples[-1].bytes == 1024 * cfg.block_size * cfg.kv_bytes_per_token
    assert prof.transfer.bytes_per_s > 0
    assert prof.decode_samples[2].context_tokens >= 4 * 65  # 4 requests of 64 prompt tokens and their outputs
    path = tmp_path / "p.json"
    save_profile(prof, path)
    assert load_profile(path) == prof
    assert isinstance(load_profile(path), Profile)


def test_calibration_takes_the_median_overheads_beyond_the_engine() -> None:
    prof = make_profile()  # prefill 10 ms + 1 ms/token, transfer 5 ms, decode 20 ms a step
    # 40-token prompts: engine TTFT 0.01 + 0.04 + 0.005 = 0.055; measured 0.075, 0.085, 0.095 -> +30 ms;
    # gaps 0.021-0.025 around a 20 ms step -> +3 ms
    samples = [(0.075, [0.021, 0.023], 40), (0.095, [0.025], 40), (0.085, [0.022, 0.024], 40)]
    cal = apply_calibration(prof, samples, 16, "a test")
    assert cal.request_overhead_s == pytest.approx(0.030)
    assert cal.decode.base_s == pytest.approx(0.023)
    assert cal.decode.per_seq_s == prof.decode.per_seq_s  # host sharing is host_cores', not a request's
    assert "request overhead 30.0 ms, decode step +3.0 ms" in cal.notes
    tabled = dataclasses.replace(prof, decode=DecodeCost(0.02, 0.0, 0.0, ((1, 0.02), (4, 0.05))))
    cal = apply_calibration(tabled, samples, 16, "a test")  # a table: every batch size's step +3 ms
    assert [b for b, _ in cal.decode.by_batch] == [1, 4]
    assert [t for _, t in cal.decode.by_batch] == pytest.approx([0.023, 0.053])
    assert cal.decode.step_s(2, 0) == pytest.approx(0.033)
    faster = apply_calibration(prof, [(0.01, [0.01], 40)], 16, "x")  # never below the engine's own costs
    assert faster.request_overhead_s == 0.0 and faster.decode.base_s == prof.decode.base_s


def test_simulate_command_reads_a_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prof = tmp_path / "p.json"
    save_profile(make_profile(), prof)
    trace = tmp_path / "t.csv"
    trace.write_text("arrival_s,input_tokens,output_tokens,prefix_id\n0,100,5,-1\n1.0,100,5,-1\n")
    out = tmp_path / "out.json"
    assert main(["simulate", "--profile", str(prof), "--trace", str(trace), "--json", str(out)]) == 0
    assert "1P:1D: 2/2 requests done" in capsys.readouterr().out
    result = json.loads(out.read_text())["result"]
    assert result["ttft"]["p50"] == pytest.approx(0.125) and result["e2e"]["p50"] == pytest.approx(0.205)
    assert main(["simulate", "--profile", str(prof), "--trace", str(trace), "--rate", "2"]) == 2
    assert "--trace: its arrival times set the load" in capsys.readouterr().err


def test_simulate_uses_the_profiles_host_cores_unless_told(tmp_path: Path) -> None:
    prof = tmp_path / "p.json"
    save_profile(dataclasses.replace(make_profile(), host_cores=1.0), prof)
    trace = tmp_path / "t.csv"
    trace.write_text("arrival_s,input_tokens,output_tokens,prefix_id\n0,100,5,-1\n0,100,5,-1\n")
    ends = []
    for extra in ([], ["--host-cores", "0"]):
        out = tmp_path / "out.json"
        args = ["simulate", "--profile", str(prof), "--trace", str(trace), "--json", str(out), *extra]
        assert main(args) == 0
        ends.append(json.loads(out.read_text())["result"]["e2e"]["mean"])
    # as in test_simulator: the two end at 0.285 and 0.395 sharing one core, 0.205 and 0.315 alone
    assert ends[0] == pytest.approx(0.34) and ends[1] == pytest.approx(0.26)
    data = json.loads(prof.read_text())
    data["host_cores"] = 0
    prof.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="host_cores must be > 0"):
        load_profile(prof)

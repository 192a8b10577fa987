"""``bench/lab/sim_validation.py``: a bench run's requests as the simulator's trace, and the run's throughput
on the simulator's definition."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.lab.sim_validation import requests_to_trace, run_throughput
from bench.report import REQUEST_FIELDS
from planner.simulator import RequestSpec
from planner.workload import read_trace


def _requests(run: Path, rows: list[dict[str, object]]) -> None:
    run.mkdir()
    lines = [",".join(REQUEST_FIELDS)]
    for row in rows:
        lines.append(",".join(str(row.get(f, "")) for f in REQUEST_FIELDS))
    (run / "requests.csv").write_text("\n".join(lines) + "\n")


def test_a_runs_requests_become_a_trace_with_their_prefixes(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _requests(run, [
        {"session": 0, "turn": 0, "label": "prefix1", "status": "ok", "start_s": "0.5", "e2e_s": "2.0",
         "prompt_tokens": 430, "output_tokens": 32},
        {"session": 1, "turn": 0, "label": "unique", "status": "ok", "start_s": "0.0", "e2e_s": "1.0",
         "prompt_tokens": 431, "output_tokens": 32},
        {"session": 2, "turn": 0, "label": "prefix1", "status": "error", "start_s": "3.0", "e2e_s": "0.1",
         "prompt_tokens": 429, "output_tokens": 0},  # failed: still sent, so still simulated
    ])
    trace = tmp_path / "t.csv"
    assert requests_to_trace(run, trace, prefix_len=384) == 3
    assert read_trace(trace) == [RequestSpec(431, 32, 0.0, -1, 0), RequestSpec(430, 32, 0.5, 3, 384),
                                 RequestSpec(429, 1, 3.0, 3, 384)]
    # completed requests over first send (0.0) to last answer (0.5 + 2.0)
    assert run_throughput(run) == pytest.approx(2 / 2.5)
    requests_to_trace(run, trace)  # no prefix length: nothing shared
    assert {s.prefix_id for s in read_trace(trace)} == {-1}

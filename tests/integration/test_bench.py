"""``pdserve bench`` against a real disaggregated ``pdserve serve``: every workload in closed-loop
(concurrency) mode, one run in open-loop (rate) mode, and a short sweep."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Any

import pytest

from cli.main import main
from tests.integration.conftest import PdserveServer

pytestmark = pytest.mark.slow

TINY = {
    "random": "input_len=24,output_len=6",
    "shared-prefix": "num_prefixes=2,questions_per_prefix=3,prefix_len=48,question_len=6,output_len=4",
    "multi-turn": "turns=3,user_len=8,output_len=4",
    "long-context": "context_len=160,output_len=4,margin=8",
    "mixed": "rag_share=0.5,short_min=6,short_max=12,rag_min=64,rag_max=96,rag_system_len=8,"
             "output_min=3,output_max=6",
}
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _bench(url: str, out: Path, workload: str, *extra: str) -> dict[str, Any]:
    code = main(["bench", "--url", url, "--workload", workload, "--param", TINY[workload], "--duration", "2",
                 "--output", str(out), "--slo", "ttft=30s,itl=5s", "--metrics-interval", "0.5",
                 "--no-progress", "--drain-timeout", "60", *extra])
    assert code == 0
    summary: dict[str, Any] = json.loads((out / "summary.json").read_text())
    return summary


def _check_files(out: Path, summary: dict[str, Any], expect_metrics: bool) -> list[dict[str, str]]:
    assert summary["completed"] > 0 and summary["failed"] == 0 and summary["errors"] == {}
    assert summary["requests"] == summary["completed"]
    for key in ("ttft", "itl", "tpot", "e2e"):
        d = summary[key]
        assert set(d) == {"count", "mean_ms", "p50_ms", "p90_ms", "p99_ms"}
        if d["count"]:
            assert 0 < d["p50_ms"] <= d["p90_ms"] <= d["p99_ms"]
    assert summary["ttft"]["count"] == summary["completed"]
    assert summary["e2e"]["p50_ms"] >= summary["ttft"]["p50_ms"]
    assert summary["output_throughput"] > 0 and summary["request_throughput"] > 0
    assert 0 <= summary["slo_attainment"] <= 1 and summary["goodput"] <= summary["request_throughput"] + 1e-9
    rows = list(csv.DictReader((out / "requests.csv").open()))
    assert len(rows) == summary["requests"] and all(r["status"] == "ok" for r in rows)
    assert sum(int(r["output_tokens"]) for r in rows) == summary["output_tokens"]
    assert (out / "latency_cdf.png").read_bytes().startswith(PNG_MAGIC)
    if expect_metrics:
        metrics = list(csv.DictReader((out / "metrics.csv").open()))
        assert metrics and all(0.0 <= float(m["kv_usage"]) <= 1.0 for m in metrics)
        assert "queue_depth" in metrics[0] and "kv_utilisation" in metrics[0]
        assert (out / "timeline.png").read_bytes().startswith(PNG_MAGIC)
    return rows


@pytest.mark.parametrize("workload", list(TINY))
def test_every_workload_against_pdserve(pdserve_server: PdserveServer, tmp_path: Path, workload: str) -> None:
    # a later turn starts only inside --duration: give multi-turn room for a slow first turn on a busy host
    # (6 s were too few beside a CPU hog)
    longer = ("--duration", "15") if workload == "multi-turn" else ()
    summary = _bench(pdserve_server.url, tmp_path, workload, "--concurrency", "2", *longer)
    rows = _check_files(tmp_path, summary, expect_metrics=True)
    cfg = summary["config"]
    assert cfg["workload"]["name"] == workload and cfg["concurrency"] == 2 and cfg["model"]
    out_len = {"random": 6, "shared-prefix": 4, "multi-turn": 4, "long-context": 4}.get(workload)
    for r in rows:  # ignore_eos: each request produced exactly what it asked for
        if out_len is not None:
            assert int(r["output_tokens"]) == out_len
        else:
            assert 3 <= int(r["output_tokens"]) <= 6
    prompts = [int(r["prompt_tokens"]) for r in rows]
    if workload == "random":
        assert all(p >= 24 for p in prompts)
    if workload == "long-context":
        assert all(140 <= p <= 160 for p in prompts)
    if workload == "multi-turn":  # later turns resend the history, so their prompts are longer
        by_session: dict[str, list[tuple[int, int]]] = {}
        for r in rows:
            by_session.setdefault(r["session"], []).append((int(r["turn"]), int(r["prompt_tokens"])))
        grown = [s for s in by_session.values() if len(s) > 1]
        assert grown, "no session reached a second turn"
        for turns in grown:
            lengths = [p for _, p in sorted(turns)]
            assert lengths == sorted(lengths) and lengths[0] < lengths[-1]
    if workload == "shared-prefix":
        assert summary["server_metrics"]["kv_usage_max"] is not None


def test_rate_mode_and_a_sweep(pdserve_server: PdserveServer, tmp_path: Path) -> None:
    other = pdserve_server
    summary = _bench(other.url, tmp_path / "run", "random", "--rate", "2")
    _check_files(tmp_path / "run", summary, expect_metrics=True)
    assert summary["config"]["rate"] == 2.0
    code = main(["bench", "sweep", "--url", other.url, "--workload", "random", "--param", TINY["random"],
                 "--duration", "1.5", "--output", str(tmp_path / "sweep"), "--slo", "ttft=30s",
                 "--start-rate", "1", "--max-steps", "2", "--refine", "0", "--no-progress"])
    assert code == 0
    sweep = json.loads((tmp_path / "sweep" / "sweep.json").read_text())
    assert [p["rate"] for p in sweep["points"]] == [1.0, 2.0]
    assert all(p["slo_attainment"] == 1.0 for p in sweep["points"])  # a 30 s TTFT bound is always met
    assert sweep["max_goodput"] > 0 and not math.isnan(sweep["max_goodput"])
    assert (tmp_path / "sweep" / "sweep.png").read_bytes().startswith(PNG_MAGIC)
    assert (tmp_path / "sweep" / "rate_2" / "summary.json").is_file()


def test_bench_errors_name_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--url", "http://127.0.0.1:9", "--workload", "random"]) == 2
    assert "--rate or --concurrency" in capsys.readouterr().err
    assert main(["bench", "--url", "http://127.0.0.1:9", "--rate", "0"]) == 2
    assert "--rate" in capsys.readouterr().err
    assert main(["bench", "sweep", "--url", "http://127.0.0.1:9"]) == 2
    assert "--slo" in capsys.readouterr().err
    assert main(["bench", "--url", "http://127.0.0.1:9", "--rate", "1"]) == 1
    assert "cannot reach" in capsys.readouterr().err

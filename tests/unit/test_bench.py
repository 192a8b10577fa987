"""bench/: workloads (seeded, token counts checked with the real tokenizer), statistics, goodput, parsing,
and the docs sections the bench tools rewrite."""

from __future__ import annotations

import importlib
import math
from itertools import islice
from pathlib import Path

import numpy as np
import pytest

from bench.client import metrics_sample, parse_prometheus, workers_sample
from bench.sections import replace_section
from bench.stats import SLO, RequestRecord, describe, parse_slo, percentile, summarize
from bench.workloads import WORKLOADS, WordSource, make_workload, parse_params
from engine.kv_cache import KVCacheManager

SMALL: dict[str, dict[str, float]] = {
    "random": {"input_len": 40, "output_len": 8},
    "shared-prefix": {"num_prefixes": 3, "questions_per_prefix": 4, "prefix_len": 48, "question_len": 8,
                      "output_len": 8, "share": 0.75},
    "multi-turn": {"turns": 3, "user_len": 12, "output_len": 8},
    "long-context": {"context_len": 300, "output_len": 8, "margin": 16},
    "mixed": {"rag_share": 0.3, "short_min": 8, "short_max": 24, "rag_min": 100, "rag_max": 160,
              "rag_system_len": 16, "output_min": 4, "output_max": 12},
    "copy-heavy": {"sentences": 3, "functions": 1, "code_share": 0.5, "output_len": 16},
}


@pytest.fixture(scope="module")
def words(default_model_path: Path) -> WordSource:
    from engine.loader import load_model_source

    return WordSource(load_model_source(default_model_path).load_tokenizer())


@pytest.mark.parametrize("name", WORKLOADS)
def test_workload_is_seeded_and_counts_tokens(words: WordSource, name: str) -> None:
    wl = make_workload(name, SMALL[name])
    first = list(islice(wl.sessions(words, seed=7), 24))
    again = list(islice(wl.sessions(words, seed=7), 24))
    other = list(islice(wl.sessions(words, seed=8), 24))
    assert first == again
    assert first != other
    p = wl.params
    for s in first:
        assert s.turns
        for t in s.turns:
            assert words.count(t.text) == t.text_tokens  # the stated count is the tokenizer's
            assert t.max_tokens > 0
        if s.system is not None:
            assert words.count(s.system) == s.system_tokens
        if name == "random":
            assert s.kind == "completion" and s.turns[0].text_tokens == p["input_len"]
            assert s.turns[0].max_tokens == p["output_len"]
        elif name == "shared-prefix":
            assert s.kind == "chat" and s.system_tokens == p["prefix_len"]
            assert s.turns[0].text_tokens == p["question_len"]
        elif name == "multi-turn":
            assert len(s.turns) == p["turns"] and all(t.text_tokens == p["user_len"] for t in s.turns)
        elif name == "copy-heavy":  # the answer repeats what the prompt supplies
            assert s.kind == "chat" and s.label in ("quote", "code-edit") and t.max_tokens == p["output_len"]
            assert ("```python" in t.text) == (s.label == "code-edit")
        elif name == "long-context":
            total = s.turns[0].text_tokens + s.turns[0].max_tokens
            assert p["context_len"] - p["margin"] - 8 <= total <= p["context_len"]
        else:
            t = s.turns[0]
            assert p["output_min"] <= t.max_tokens <= p["output_max"]
            if s.label == "rag":
                assert p["rag_min"] + p["short_min"] <= t.text_tokens <= p["rag_max"] + p["short_max"] + 4
            else:
                assert s.label == "chat" and p["short_min"] <= t.text_tokens <= p["short_max"]


def test_shared_prefix_shares_system_prompts(words: WordSource) -> None:
    wl = make_workload("shared-prefix", {**SMALL["shared-prefix"], "share": 1.0})
    sessions = list(islice(wl.sessions(words, seed=0), 24))
    systems = {s.system for s in sessions}
    assert len(systems) == 3  # num_prefixes distinct system prompts, each used by 4 questions per round
    assert sorted(s.label for s in sessions[:12]) == sorted(f"prefix{i}" for i in range(3) for _ in range(4))
    unshared = list(islice(make_workload("shared-prefix", {**SMALL["shared-prefix"], "share": 0.0})
                           .sessions(words, seed=0), 12))
    assert len({s.system for s in unshared}) == 12


def test_mixed_has_both_kinds_and_multi_turn_carries_history(words: WordSource) -> None:
    labels = [s.label for s in islice(make_workload("mixed", SMALL["mixed"]).sessions(words, 1), 60)]
    assert 5 <= labels.count("rag") <= 35 and labels.count("chat") + labels.count("rag") == 60
    s = next(make_workload("multi-turn", SMALL["multi-turn"]).sessions(words, 0))
    msgs = s.messages(2, ["first answer", "second answer"])
    assert [m["role"] for m in msgs] == ["user", "assistant", "user", "assistant", "user"]
    assert msgs[1]["content"] == "first answer" and msgs[4]["content"] == s.turns[2].text


def test_workload_errors_name_the_flag() -> None:
    with pytest.raises(ValueError, match="--workload"):
        make_workload("nope")
    with pytest.raises(ValueError, match="--param.*input_len"):
        make_workload("random", {"bogus": 1})
    with pytest.raises(ValueError, match="--param"):
        parse_params(["input_len"])
    assert parse_params(["input_len=12,output-len=3", "share=0.5"]) == {"input_len": 12, "output_len": 3,
                                                                        "share": 0.5}


def test_percentiles_match_numpy() -> None:
    rng = np.random.default_rng(0)
    values = list(rng.exponential(size=101))
    for q in (0, 50, 90, 99, 100):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    assert percentile([3.0], 99) == 3.0 and math.isnan(percentile([], 50))
    d = describe([0.1, 0.2, 0.3, 0.4])
    assert d["count"] == 4 and d["mean_ms"] == pytest.approx(250) and d["p50_ms"] == pytest.approx(250)


def _rec(ttft: float, gaps: list[float], out: int, status: str = "ok") -> RequestRecord:
    e2e = ttft + sum(gaps)
    return RequestRecord(start=0.0, status=status, ttft=ttft, e2e=e2e, chunk_gaps=gaps, prompt_tokens=10,
                         output_tokens=out)


def test_goodput_against_slo() -> None:
    records = [
        _rec(0.5, [0.1, 0.1, 0.1], 4),   # meets ttft=1s, itl=200ms
        _rec(1.5, [0.1, 0.1, 0.1], 4),   # ttft too slow
        _rec(0.2, [0.3, 0.3], 3),        # itl too slow
        _rec(0.9, [0.05, 0.35], 3),      # mean itl 0.2: meets (bound inclusive)
        RequestRecord(start=0.0, status="503"),
    ]
    s = summarize(records, duration=10.0, slo=parse_slo("ttft=1s,itl=200"))
    assert s["requests"] == 5 and s["completed"] == 4 and s["failed"] == 1 and s["errors"] == {"503": 1}
    assert s["good_requests"] == 2
    assert s["slo_attainment"] == pytest.approx(0.4)
    assert s["goodput"] == pytest.approx(0.2)
    assert s["good_output_throughput"] == pytest.approx(0.7)
    assert s["output_throughput"] == pytest.approx(1.4)
    assert s["request_throughput"] == pytest.approx(0.4)
    assert s["ttft"]["count"] == 4 and s["itl"]["count"] == 10
    assert records[0].tpot == pytest.approx(0.1) and records[2].tpot == pytest.approx(0.3)
    assert SLO(e2e=1.0).met(records[0]) is True and SLO(e2e=0.7).met(records[0]) is False
    assert "slo" not in summarize(records, 10.0, None)


def test_parse_slo_units_and_errors() -> None:
    assert parse_slo("ttft=500ms,itl=0.1s,e2e=20") == SLO(ttft=0.5, itl=0.1, e2e=0.02)
    for bad in ("", "ttft", "tbt=1s", "ttft=fast"):
        with pytest.raises(ValueError, match="--slo"):
            parse_slo(bad)


def test_metrics_parsing_accepts_either_names() -> None:
    current = ('# HELP x\npdserve:worker_num_used_blocks{worker="d0",role="decode"} 30.0\n'
               'pdserve:worker_num_used_blocks{worker="p0",role="prefill"} 10.0\n'
               'pdserve:worker_num_free_kv_blocks{worker="d0",role="decode"} 60.0\n'
               'pdserve:worker_num_free_kv_blocks{worker="p0",role="prefill"} 100.0\n'
               "pdserve:router_queued_requests 3.0\npdserve:router_in_flight_requests 5.0\n")
    assert metrics_sample(parse_prometheus(current)) == {"kv_usage": 0.2, "queue_depth": 3.0, "running": 5.0}
    renamed = ('pdserve:kv_cache_usage_perc{worker="d0"} 0.4\npdserve:num_requests_waiting{worker="d0"} 2\n'
               "pdserve:num_requests_running 1 1700000000\n")
    assert metrics_sample(parse_prometheus(renamed)) == {"kv_usage": 0.4, "queue_depth": 2.0, "running": 1.0}
    assert metrics_sample(parse_prometheus("other_metric 1\n")) == {}
    w = workers_sample({"workers": [{"kv": {"used_blocks": 4, "block_size": 16, "stored_tokens": 60}},
                                    {"kv": {"used_blocks": 0, "block_size": 16, "stored_tokens": 0}}]})
    assert w == {"kv_stored_tokens": 60.0, "kv_token_slots": 64.0, "kv_utilisation": 60 / 64}


def test_kv_stored_tokens_counts_shared_blocks_once() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=4)
    tokens = list(range(10))
    assert kv.allocate("a", 10)
    kv.cache_blocks("a", tokens, 10)
    assert kv.num_stored_tokens() == 10 and kv.pool.num_used_blocks == 3
    hit = kv.find_prefix(tokens + [99, 98], max_tokens=11)
    assert len(hit.block_ids) == 2
    assert kv.allocate("b", 12, hit)  # shares 2 full blocks, adds one block of 4 tokens
    assert kv.pool.num_used_blocks == 4
    assert kv.num_stored_tokens() == 10 + 4
    kv.free("a")
    assert kv.num_stored_tokens() == 12


DOC = Path(__file__).resolve().parents[2] / "docs" / "benchmarks.md"


def test_replace_section_rewrites_between_its_markers_only(tmp_path: Path) -> None:
    doc = tmp_path / "b.md"
    doc.write_text("# B\n\nbefore\n\n<!-- x:begin -->\nold\n<!-- x:end -->\n\nafter <!-- y:begin -->\n")
    replace_section(doc, "<!-- x:begin -->\nnew\n<!-- x:end -->", "<!-- x:begin -->", "<!-- x:end -->")
    assert doc.read_text() == ("# B\n\nbefore\n\n<!-- x:begin -->\nnew\n<!-- x:end -->\n\n"
                               "after <!-- y:begin -->\n")
    replace_section(doc, "<!-- z:begin -->\nz\n<!-- z:end -->", "<!-- z:begin -->", "<!-- z:end -->")
    assert doc.read_text().endswith("<!-- y:begin -->\n\n<!-- z:begin -->\nz\n<!-- z:end -->\n")


@pytest.mark.parametrize("module", ["bench.compare", "bench.compare_vllm"])
def test_the_benchmarks_page_keeps_each_tools_markers_once(module: str) -> None:
    """docs/benchmarks.md stays regenerable: each tool's begin marker appears once, before its end marker,
    so ``replace_section`` rewrites that tool's section and nothing else; or neither appears (a section
    the page does not keep: a run appends it)."""
    tool = importlib.import_module(module)
    text = DOC.read_text()
    assert text.count(tool.BEGIN) == text.count(tool.END) <= 1
    if tool.BEGIN in text:
        assert text.index(tool.BEGIN) < text.index(tool.END)

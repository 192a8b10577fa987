"""``bench.lab.moe_step``: the floor's arithmetic and the expert counting, on tiny models the bench builds
itself. No test here asserts a time: only bytes, expert counts and the section it writes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bench.lab.moe_models import Shape, model_dir
from bench.lab.moe_step import (
    BEGIN,
    END,
    WeightSplit,
    distinct_experts,
    held_total,
    main,
    mixtures,
    observing,
    run_row,
    uniform_distinct,
    weight_split,
)
from bench.lab.step_profile import start_scenario, weight_bytes
from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.layers.moe import MoE, route
from engine.models.size import parameter_count
from tests.families import save

# 2 layers, 8 experts of 32, top 2; the dense models' MLP is 2 x 32 = 64
SHAPE = Shape(hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, experts=8, expert_intermediate=32,
              top_k=2, vocab=256)
SHAPE_FLAGS = ["--hidden", "64", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--head-dim", "16",
               "--experts", "8", "--expert-intermediate", "32", "--top-k", "2", "--vocab", "256"]
# by hand, per layer: attention 64 x (64 + 2 x 32) + 64 x 64 = 12,288, q/k norms 32, two norms 128; the
# mixture's router 8 x 64 = 512 and experts 8 x 3 x 64 x 32 = 49,152 (one expert 6,144); the dense MLP
# 3 x 64 x 64 = 12,288. Then the tied embedding 256 x 64 = 16,384 and the final norm 64.
MOE_TOTAL = 2 * (12_288 + 32 + 128 + 512 + 49_152) + 16_384 + 64  # 140,672
MOE_ACTIVE = 2 * (12_288 + 32 + 128 + 512 + 2 * 6_144) + 16_384 + 64  # 66,944
DENSE_TOTAL = 2 * (12_288 + 32 + 128 + 12_288) + 16_384 + 64  # 65,920
KV_TOKEN = 2 * 2 * 2 * 16 * 4  # K and V, 2 layers, 2 KV heads of 16, float32


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe-bench")
    return {name: model_dir(name, SHAPE, root=root) for name in ("qwen3_moe", "qwen3")}


def _engine(folder: Path) -> LLMEngine:
    return LLMEngine(str(folder), EngineConfig(dtype="float32", enable_prefix_caching=False, max_num_seqs=8,
                                               kv_cache_memory=8 * 1024**2, num_threads=1))


def _prefill(engine: LLMEngine, batch: int, context: int) -> None:
    start_scenario(engine, batch, context)
    while any(r.num_computed_tokens < len(r.prompt_token_ids) for r in engine.requests.values()):
        engine.step()


def test_distinct_experts_and_uniform_routing() -> None:
    assert distinct_experts([0, 3, 0, 1, 5]) == 3
    assert distinct_experts([0, 0, 0]) == 0
    assert uniform_distinct(8, 2, 0) == 0
    assert uniform_distinct(8, 2, 1) == 2  # one token reads exactly its top k
    assert uniform_distinct(4, 4, 3) == 4
    assert uniform_distinct(24, 4, 16) == pytest.approx(22.702, abs=1e-3)  # 24 (1 - (5/6)^16)


def test_step_bytes_add_the_experts_read_rows_and_kv() -> None:
    split = WeightSplit(shared=1000, expert=10, embedding_row=4)
    assert split.step_bytes([2, 3], rows=5, kv_bytes=7) == 1000 + 10 * 5 + 4 * 5 + 7
    assert WeightSplit(500).step_bytes((), rows=16, kv_bytes=100) == 600


def test_weight_split_matches_the_parameter_count(folders: dict[str, Path]) -> None:
    engine = _engine(folders["qwen3_moe"])
    count = parameter_count(engine.model_config)
    assert (count.total, count.active, count.experts) == (MOE_TOTAL, MOE_ACTIVE, 2 * 49_152)
    split = weight_split(engine.runner.model, weight_bytes(engine))
    assert split == WeightSplit(shared=4 * (MOE_TOTAL - 2 * 49_152), expert=4 * 6_144, embedding_row=0)
    # a step that reads its top k experts in every layer reads the active bytes
    assert split.step_bytes([2, 2], rows=1, kv_bytes=0) == 4 * MOE_ACTIVE
    dense = _engine(folders["qwen3"])
    dense_count = parameter_count(dense.model_config)
    assert (dense_count.total, dense_count.active, dense_count.experts) == (DENSE_TOTAL, DENSE_TOTAL, 0)
    assert weight_split(dense.runner.model, weight_bytes(dense)) == WeightSplit(4 * DENSE_TOTAL)
    assert DENSE_TOTAL == MOE_ACTIVE - 2 * 512  # the mixture's active size, routers aside


def test_weight_split_of_an_untied_embedding_counts_one_row_a_token(tmp_path: Path) -> None:
    save("qwen3_moe", tmp_path)  # 3 layers (the first dense), 4 experts of 32, hidden 64, 255 words, untied
    engine = _engine(tmp_path)
    split = weight_split(engine.runner.model, weight_bytes(engine))
    expert = 4 * 3 * 64 * 32
    assert split == WeightSplit(shared=4 * parameter_count(engine.model_config).total - 2 * 4 * expert
                                - 4 * 255 * 64, expert=expert, embedding_row=4 * 64)


def test_expert_counts_equal_the_routing_of_each_step(folders: dict[str, Path]) -> None:
    engine = _engine(folders["qwen3_moe"])
    moes = mixtures(engine.runner.model)
    assert len(moes) == 2
    _prefill(engine, 5, 20)
    expected: list[list[int]] = []

    def routed(module: torch.nn.Module, args: tuple[torch.Tensor]) -> None:
        assert isinstance(module, MoE)
        _, ids = route(module.router_linear(args[0]), module.moe)
        expected[-1].append(len(set(ids.flatten().tolist())))

    handles = [moe.register_forward_pre_hook(routed) for moe in moes]
    try:
        with observing(moes) as reads:
            for _ in range(3):
                expected.append([])
                reads.start_step()
                engine.step()
    finally:
        for handle in handles:
            handle.remove()
    assert reads.steps == expected
    assert len(expected) == 3 and all(len(step) == 2 for step in expected)
    assert max(max(step) for step in expected) > 2  # five rows read more than one row's top 2
    assert all(moe.on_route is None for moe in moes)


def test_a_row_of_one_reads_its_top_k_and_the_kv_it_attends_over(folders: dict[str, Path]) -> None:
    engine = _engine(folders["qwen3_moe"])
    row = run_row(engine, "qwen3_moe", batch=1, context=20, repeats=2, bw_bytes=1 << 20)
    assert [s.distinct for s in row.samples] == [(2, 2), (2, 2)]
    # after the prompt's 20 tokens and two warm-up steps the first timed step attends over 23 tokens
    assert [s.bytes for s in row.samples] == [4 * MOE_ACTIVE + 23 * KV_TOKEN, 4 * MOE_ACTIVE + 24 * KV_TOKEN]
    assert row.experts_read() == [2.0, 2.0] and (row.experts, row.top_k) == (8, 2)


def test_main_rewrites_its_section_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path / "cache"))
    doc, out = tmp_path / "benchmarks.md", tmp_path / "steps.json"
    doc.write_text(f"# Benchmarks\n\nbefore\n\n{BEGIN}\nold figures\n{END}\n\nafter\n")
    assert main([*SHAPE_FLAGS, "--models", "qwen3_moe,llama", "--batches", "1,3", "--context", "8",
                 "--repeats", "1", "--bw-bytes", str(1 << 20), "--threads", "1", "--doc", str(doc),
                 "--json", str(out)]) == 0
    text = doc.read_text()
    assert text.startswith("# Benchmarks\n\nbefore\n\n") and text.endswith(f"{END}\n\nafter\n")
    assert "old figures" not in text and "**A smoke run (timed steps a row: 1)" in text
    assert "`python -m bench.lab.moe_step --hidden 64 " in text
    section = text.split(BEGIN)[1]
    for model, batch in (("qwen3_moe", 1), ("qwen3_moe", 3), ("llama", 1), ("llama", 3)):
        assert f"\n| {model} | {batch} | " in section
    assert "| llama | 1 | " in section and "one native call per step" in section
    figures = json.loads(out.read_text())
    assert [(r["model"], r["batch"]) for r in figures["rows"]] == [("qwen3_moe", 1), ("qwen3_moe", 3),
                                                                    ("llama", 1), ("llama", 3)]
    assert figures["rows"][0]["samples"][0]["distinct"] == [2, 2]
    assert [(m["name"], m["parameters"], m["active"]) for m in figures["models"]][0] == (
        "qwen3_moe", MOE_TOTAL, MOE_ACTIVE)
    assert figures["rows"][2]["samples"][0]["distinct"] == []


@pytest.mark.parametrize(("flags", "message"), [
    (["--experts", "8", "--top-k", "9"], "--top-k (9) must not exceed --experts (8)"),
    (["--models", "qwen3_moe,gemma"], "--models: unknown model 'gemma'"),
    (["--batches", "1,0"], "--batches: every value must be >= 1"),
    (["--heads", "6", "--kv-heads", "4"], "--heads (6) must be a multiple of --kv-heads (4)"),
    (["--repeats", "0"], "--repeats must be >= 1"),
])
def test_bad_flags_are_refused_by_name(flags: list[str], message: str,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(flags)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_an_fp8_checkpoints_experts_count_as_their_codes(tmp_path: Path) -> None:
    """``qwen3_moe_fp8``: the same model with attention and experts as fp8 codes, served under ``--dtype
    auto``; an expert reads its records (36 bytes per 32 weights), the rest stays float32."""
    folder = model_dir("qwen3_moe_fp8", SHAPE, root=tmp_path)
    engine = LLMEngine(str(folder), EngineConfig(enable_prefix_caching=False, max_num_seqs=8,
                                                 kv_cache_memory=8 * 1024**2, num_threads=1))
    total = held_total(engine)
    split = weight_split(engine.runner.model, total)
    expert = 64 * 64 // 32 * 36 + 64 * 32 // 32 * 36  # gate/up [64, 64] and down [64, 32]
    attention = (128 * 64 + 64 * 64) // 32 * 36  # qkv [128, 64] and o [64, 64], per layer
    assert split.expert == expert
    assert total == 4 * (MOE_TOTAL - 2 * 49_152 - 2 * 12_288) + 2 * 8 * expert + 2 * attention
    row = run_row(engine, "qwen3_moe_fp8", batch=1, context=20, repeats=1, bw_bytes=1 << 20)
    assert row.samples[0].bytes == split.step_bytes([2, 2], 1, 23 * KV_TOKEN)

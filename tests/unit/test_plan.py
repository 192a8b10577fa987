"""``pdserve plan``: the KV formula on Llama-3-70B's shape, dtypes, budgets and the engine's own sizing."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from cli.main import main
from cli.plan import make_plan, parameter_count, read_model_config
from engine.config import EngineConfig
from engine.kv_sizing import num_kv_blocks

LLAMA3_70B = {
    "architectures": ["LlamaForCausalLM"], "hidden_size": 8192, "intermediate_size": 28672,
    "num_attention_heads": 64, "num_key_value_heads": 8, "num_hidden_layers": 80, "vocab_size": 128256,
    "max_position_embeddings": 8192, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
}


@pytest.fixture
def llama70b(tmp_path: Path) -> Path:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA3_70B))
    return path


def plan_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    assert main(["plan", *argv, "--json"]) == 0
    return dict(json.loads(capsys.readouterr().out))


def test_llama3_70b_bytes_per_token(llama70b: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for kv_dtype, expected in (("float16", 327_680), ("bfloat16", 327_680), ("fp8", 163_840),
                               ("int8", 163_840), ("float32", 655_360)):
        plan = plan_json(capsys, str(llama70b), "--kv-cache-dtype", kv_dtype)
        assert plan["kv_bytes_per_token"] == expected, kv_dtype
        scales = 2 * 80 * 8 * 4 if kv_dtype in ("fp8", "int8") else 0  # one float32 scale per K/V head
        assert plan["kv_block_bytes"] == 16 * expected + scales
    assert plan_json(capsys, str(llama70b), "--dtype", "float16")["kv_bytes_per_token"] == 327_680  # auto


def test_llama3_70b_on_a_device(llama70b: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = read_model_config(llama70b)
    assert parameter_count(model) == 70_553_706_496  # Meta's published 70.6 B
    weights = parameter_count(model) * 2
    device = 192 * 1024**3
    plan = plan_json(capsys, str(llama70b), "--device-memory", "192G", "--gpu-memory-utilization", "0.9",
                     "--kv-cache-dtype", "fp8", "--max-model-len", "4096", "--block-size", "32")
    budget = int(device * 0.9) - weights
    assert plan["weight_bytes"] == weights and plan["kv_budget_bytes"] == budget
    assert plan["num_kv_blocks"] == budget // (32 * 163_840 + 2 * 80 * 8 * 4)
    assert plan["kv_tokens"] == plan["num_kv_blocks"] * 32
    assert plan["concurrent_sequences"] == plan["num_kv_blocks"] // (4096 // 32)
    assert plan["sequences_at"]["2048"] == plan["num_kv_blocks"] // 64
    table = make_plan(model, kv_cache_dtype="float16", device_memory=80 * 1024**3)
    assert table.num_kv_blocks == 0 and table.kv_budget_bytes < 0  # 141 GB of weights do not fit in 80 GB


def test_table_output(llama70b: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", str(llama70b), "--kv-cache-dtype", "fp8", "--device-memory", "141G"]) == 0
    out = capsys.readouterr().out
    assert "KV bytes per token    163,840" in out
    assert "80 layers, 8 KV heads x 128" in out and "concurrent sequences" in out


def test_smollm2_gguf_blocks_match_engine_sizing(default_model_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """The running engine's count is checked in tests/integration/test_ray_cluster.py (/v1/workers)."""
    budget = 64 * 1024**2
    plan = plan_json(capsys, str(default_model_path), "--kv-cache-memory", "64M", "--dtype", "float32")
    model = read_model_config(default_model_path)
    assert model.kv_bytes_per_token(2) == 23_040  # DESIGN.md: 2 x 30 x 3 x 64 x 2
    engine = num_kv_blocks(model, EngineConfig(dtype="float32", kv_cache_memory=budget))
    assert plan["num_kv_blocks"] == engine == budget // (16 * 46_080) == 91
    assert plan["concurrent_sequences"] == engine // math.ceil(model.max_position_embeddings / 16)
    odd = 1000 * 1024**2 + 12345
    bf16 = make_plan(model, dtype="bfloat16", kv_cache_memory=odd, block_size=32)
    # a bfloat16 cache, as on a GPU (the CPU's native bfloat16 products keep a float32 one: cpu_engine.md)
    on_device = EngineConfig(dtype="bfloat16", native_kernels=False, kv_cache_memory=odd, block_size=32)
    assert bf16.num_kv_blocks == num_kv_blocks(model, on_device) == odd // (32 * 23_040)


def test_bad_flags(llama70b: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", str(llama70b), "--kv-cache-dtype", "fp4"]) == 2
    assert "--kv-cache-dtype" in capsys.readouterr().err
    assert main(["plan", str(llama70b), "--gpu-memory-utilization", "1.5"]) == 2
    assert "--gpu-memory-utilization" in capsys.readouterr().err
    assert main(["plan", str(llama70b.parent / "missing.json")]) == 2
    assert "not found" in capsys.readouterr().err

"""Tensor-parallel sharding arithmetic, sliced loading (safetensors, GGUF) and `pdserve plan` per device."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from cli.main import main
from cli.plan import make_plan, read_model_config
from engine.config import ModelConfig
from engine.gguf_loader import iter_gguf_weights
from engine.hf_loader import iter_hf_weights, read_hf_config
from engine.loader import load_model_source
from engine.tensor_parallel import TpShard, WeightSlice

LLAMA3_70B = {
    "architectures": ["LlamaForCausalLM"], "hidden_size": 8192, "intermediate_size": 28672,
    "num_attention_heads": 64, "num_key_value_heads": 8, "num_hidden_layers": 80, "vocab_size": 128256,
    "max_position_embeddings": 8192, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
}


def config(heads: int, kv: int, inter: int = 96, vocab: int = 255) -> ModelConfig:
    return ModelConfig(architecture="llama", vocab_size=vocab, hidden_size=8 * heads, intermediate_size=inter,
                       num_layers=2, num_heads=heads, num_kv_heads=kv, head_dim=8, rms_norm_eps=1e-6,
                       rope_theta=10000.0, max_position_embeddings=256, name="m")


def test_heads_split_and_kv_heads_replicated_past_their_count() -> None:
    gqa = config(8, 2)
    assert [TpShard(gqa, r, 2).head_range for r in range(2)] == [(0, 4), (4, 8)]
    assert [TpShard(gqa, r, 2).kv_head_range for r in range(2)] == [(0, 1), (1, 2)]
    assert [TpShard(gqa, r, 4).kv_head_range for r in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert [TpShard(config(8, 1), r, 2).kv_head_range for r in range(2)] == [(0, 1), (0, 1)]
    smol = config(9, 3, inter=1536, vocab=49152)
    assert [TpShard(smol, r, 3).kv_head_range for r in range(3)] == [(0, 1), (1, 2), (2, 3)]
    down = TpShard(smol, 2, 3).weight_slice("model.layers.4.mlp.down_proj.weight")
    assert down == WeightSlice(1, 1024, 1536)
    # the vocabulary: ceil(255 / 2) = 128 rows per rank, the last rank's tail padded
    assert [TpShard(gqa, r, 2).vocab_range for r in range(2)] == [(0, 128), (128, 255)]
    assert TpShard(gqa, 1, 2).weight_slice("lm_head.weight") == WeightSlice(0, 128, 255)
    assert TpShard(gqa, 1, 2).weight_slice("model.layers.0.input_layernorm.weight") is None


@pytest.mark.parametrize(("heads", "kv", "sizes"), [(8, 2, (1, 2, 4, 8)), (8, 1, (1, 2, 4)), (9, 3, (1, 3)),
                                                      (64, 8, (1, 2, 4, 8, 16))])
def test_each_rank_holds_the_kv_heads_its_query_heads_read(heads: int, kv: int,
                                                           sizes: tuple[int, ...]) -> None:
    c = config(heads, kv, inter=96 * 16)
    for size in sizes:
        for rank in range(size):
            shard = TpShard(c, rank, size)
            k0, k1 = shard.kv_head_range
            assert all(k0 <= h // c.q_per_kv < k1 for h in range(*shard.head_range))
            assert k1 - k0 == shard.num_kv_heads == max(kv // size, 1)


@pytest.mark.parametrize(("heads", "kv", "size", "error"), [
    (9, 3, 2, "does not divide the 9 query heads"),
    (6, 2, 3, "must divide the 2 KV heads"),
    (8, 2, 0, "at least 1"),
])
def test_sizes_that_cannot_split_are_refused(heads: int, kv: int, size: int, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        TpShard(config(heads, kv), 0, size)


def test_safetensors_reads_only_each_ranks_slice(tiny_model_dir: Path) -> None:
    model = read_hf_config(tiny_model_dir)
    full = dict(iter_hf_weights(tiny_model_dir))
    for rank in range(2):
        shard = TpShard(model, rank, 2)
        sliced = dict(iter_hf_weights(tiny_model_dir, shard))
        assert sliced.keys() == full.keys()
        for name, tensor in sliced.items():
            cut = shard.weight_slice(name)
            expected = full[name] if cut is None else cut.take(full[name])
            assert torch.equal(tensor, expected), name
        assert sliced["model.layers.0.self_attn.k_proj.weight"].shape == (16, 64)  # 1 of 2 KV heads of 16


def test_gguf_cuts_rows_before_dequantizing_and_columns_after(default_model_path: Path) -> None:
    model = load_model_source(default_model_path).config
    n = 14  # the embedding, then layer 0's tensors (q/k permuted for llama.cpp, o, gate/up, down)
    full = dict(itertools.islice(iter_gguf_weights(default_model_path, model), n))
    shard = TpShard(model, 2, 3)
    sliced = dict(itertools.islice(iter_gguf_weights(default_model_path, model, shard), n))
    assert {"model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
            "model.layers.0.mlp.down_proj.weight"} <= sliced.keys()
    for name, tensor in sliced.items():
        cut = shard.weight_slice(name)
        assert torch.equal(tensor, full[name] if cut is None else cut.take(full[name])), name


@pytest.fixture
def llama70b(tmp_path: Path) -> Path:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA3_70B))
    return path


def plan_json(capsys: pytest.CaptureFixture[str], *argv: str) -> Any:
    assert main(["plan", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_llama3_70b_at_tp4_fits_80gib_devices(llama70b: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plan = plan_json(capsys, str(llama70b), "--tensor-parallel-size", "4", "--device-memory", "80GiB")
    # per device: 16 of 64 query heads, 2 of 8 KV heads, 7168 of 28672 MLP rows, 32064 vocabulary rows
    per_layer = 8192 * (16 + 2 * 2) * 128 + 16 * 128 * 8192 + 3 * 8192 * 7168 + 2 * 8192
    params = 2 * 32064 * 8192 + 80 * per_layer + 8192
    assert plan["weight_bytes"] == 2 * params == 35_278_831_616  # 32.86 GiB
    assert plan["kv_heads_per_device"] == 2 and plan["kv_bytes_per_token"] == 2 * 80 * 2 * 128 * 2
    budget = int(80 * 1024**3 * 0.9) - 2 * params
    assert plan["kv_budget_bytes"] == budget and plan["num_kv_blocks"] == budget // (16 * 81_920) == 32_066
    assert plan["concurrent_sequences"] == 32_066 // (8192 // 16) == 62
    assert main(["plan", str(llama70b), "--tensor-parallel-size", "4", "--device-memory", "80GiB"]) == 0
    out = capsys.readouterr().out
    assert any(line.startswith("weights per device") and line.endswith(" 32.86 GiB (bfloat16)")
               for line in out.splitlines())
    assert "4 devices, 2 KV heads per device" in out and "no room for KV" not in out
    whole = make_plan(read_model_config(llama70b), device_memory=80 * 1024**3)
    assert whole.num_kv_blocks == 0  # TP=1: 131 GiB of weights on one 80 GiB device


def test_plan_per_role_and_bad_sizes(llama70b: Path, capsys: pytest.CaptureFixture[str]) -> None:
    both = plan_json(capsys, str(llama70b), "--prefill-tp", "8", "--decode-tp", "16",
                     "--device-memory", "80GiB")
    assert both["prefill"]["tensor_parallel_size"] == 8 and both["prefill"]["kv_heads_per_device"] == 1
    assert both["decode"]["kv_heads_per_device"] == 1  # 8 KV heads over 16 devices: replicated
    assert both["decode"]["weight_bytes"] < both["prefill"]["weight_bytes"]
    assert both["decode"]["kv_bytes_per_token"] == both["prefill"]["kv_bytes_per_token"]
    assert main(["plan", str(llama70b), "--tensor-parallel-size", "3"]) == 2
    assert "--tensor-parallel-size 3: tensor_parallel_size 3 does not divide the 64 query heads" in \
        capsys.readouterr().err
    assert main(["plan", str(llama70b), "--decode-tp", "5"]) == 2
    assert "--decode-tp 5" in capsys.readouterr().err


def test_plan_at_tp1_is_unchanged(llama70b: Path) -> None:
    model = read_model_config(llama70b)
    one = make_plan(model, device_memory=192 * 1024**3)
    assert one.kv_heads_per_device == 8 and one.weight_bytes == 2 * 70_553_706_496
    assert one.kv_bytes_per_token == 327_680 and one.tensor_parallel_size == 1


def test_cli_sizes_that_cannot_run_name_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    """Refused before any rank process (or Ray) starts."""
    assert main(["generate", "--tensor-parallel-size", "2", "hi"]) == 2
    assert "--tensor-parallel-size 2: tensor_parallel_size 2 does not divide the 9 query heads" in \
        capsys.readouterr().err
    assert main(["serve", "--tensor-parallel-size", "2"]) == 2
    err = capsys.readouterr().err
    assert "--tensor-parallel-size 2: tensor_parallel_size 2 does not divide the 9 query heads" in err
    assert main(["serve", "--tensor-parallel-size", "3", "--prefill-tp", "2"]) == 2
    assert "--prefill-tp 2: tensor_parallel_size 2 does not divide" in capsys.readouterr().err

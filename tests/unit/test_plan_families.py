"""``pdserve plan`` on the published configs of Qwen3-235B-A22B, gpt-oss-120b and Gemma-3-27B (their
config.json values written out here): weight bytes, active bytes per token and KV bytes per token per
layer group, each against the arithmetic done by hand below."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from cli.main import main

QWEN3_235B = {  # Qwen/Qwen3-235B-A22B config.json
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "attention_bias": False,
    "decoder_sparse_step": 1, "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096,
    "intermediate_size": 12288, "max_position_embeddings": 40960, "max_window_layers": 94,
    "mlp_only_layers": [],
    "moe_intermediate_size": 1536, "norm_topk_prob": True, "num_attention_heads": 64, "num_experts": 128,
    "num_experts_per_tok": 8, "num_hidden_layers": 94, "num_key_value_heads": 4, "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0, "sliding_window": None, "tie_word_embeddings": False,
    "use_sliding_window": False, "vocab_size": 151936,
}
GPT_OSS_120B = {  # openai/gpt-oss-120b config.json (its MXFP4 quantization_config left out)
    "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "attention_bias": True,
    "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880,
    "initial_context_length": 4096, "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * 18, "max_position_embeddings": 131072,
    "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": 36, "num_key_value_heads": 8,
    "num_local_experts": 128, "rms_norm_eps": 1e-05,
    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                     "original_max_position_embeddings": 4096, "rope_type": "yarn", "truncate": False},
    "rope_theta": 150000, "sliding_window": 128, "swiglu_limit": 7.0, "tie_word_embeddings": False,
    "vocab_size": 201088,
}
GEMMA3_27B = {  # google/gemma-3-27b-it's text_config, as a text-only Gemma3ForCausalLM
    "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "head_dim": 128, "hidden_size": 5376,
    "intermediate_size": 21504, "max_position_embeddings": 131072, "num_attention_heads": 32,
    "num_hidden_layers": 62, "num_key_value_heads": 16, "query_pre_attn_scalar": 168, "rms_norm_eps": 1e-06,
    "rope_local_base_freq": 10000.0, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
    "rope_theta": 1000000.0, "sliding_window": 1024, "sliding_window_pattern": 6, "vocab_size": 262208,
}


def plan(tmp_path: Path, capsys: pytest.CaptureFixture[str], config: dict[str, Any],
         *argv: str) -> dict[str, Any]:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    assert main(["plan", str(path), "--json", *argv]) == 0
    return dict(json.loads(capsys.readouterr().out))


def group(attention: str, window: int | None, layers: int, groups: int, per_token: int) -> dict[str, Any]:
    return {"attention": attention, "window": window, "layers": layers, "groups": groups,
            "kv_bytes_per_token": per_token}


def test_qwen3_235b_a22b(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = plan(tmp_path, capsys, QWEN3_235B)
    h, layers, vocab = 4096, 94, 151936
    attention = h * 64 * 128 + 2 * h * 4 * 128 + 64 * 128 * h + 2 * 128  # q, k and v, o, q/k norms
    expert = 3 * h * 1536
    router = 128 * h
    layer = attention + 2 * h + router
    total = layers * (layer + 128 * expert) + 2 * vocab * h + h
    active = layers * (layer + 8 * expert) + 2 * vocab * h + h
    assert p["parameters"] == total and round(total / 1e9) == 235
    assert p["active_parameters"] == active and round(active / 1e9) == 22  # "A22B"
    assert p["weight_bytes"] == 2 * total and p["active_weight_bytes"] == 2 * active
    assert p["kv_groups"] == [group("full", None, 94, 1, 94 * 2 * 4 * 128 * 2)]
    assert p["kv_bytes_per_token"] == 192_512 and p["kv_block_slots"] == 94


def test_gpt_oss_120b(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = plan(tmp_path, capsys, GPT_OSS_120B, "--max-model-len", "8192")
    h, layers, vocab = 2880, 36, 201088
    q, kv = 64 * 64, 8 * 64
    attention = h * q + 2 * h * kv + q * h + (q + 2 * kv) + h + 64  # with q/k/v and o biases, 64 sinks
    expert = 3 * h * 2880 + 2 * 2880 + h  # gate/up/down and their biases
    router = 128 * h + 128
    layer = attention + 2 * h + router
    total = layers * (layer + 128 * expert) + 2 * vocab * h + h
    active = layers * (layer + 4 * expert) + 2 * vocab * h + h
    assert p["parameters"] == total and round(total / 1e9, 1) == 116.8
    assert p["active_parameters"] == active
    per_layer = 2 * 8 * 64 * 2
    assert p["kv_groups"] == [group("full", None, 18, 1, 18 * per_layer),
                              group("sliding", 128, 18, 1, 18 * per_layer)]
    # blocks of 16 tokens x 18 layers; 8k tokens hold 512 full blocks and 128 / 16 + 1 sliding ones
    assert p["kv_block_slots"] == 18 and p["kv_block_bytes"] == 16 * 18 * per_layer
    assert p["blocks_per_sequence"] == 512 + 9
    assert p["concurrent_sequences"] == p["num_kv_blocks"] // 521


def test_gemma3_27b(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = plan(tmp_path, capsys, GEMMA3_27B, "--max-model-len", "8192")
    h, layers, vocab = 5376, 62, 262208
    q, kv = 32 * 128, 16 * 128
    attention = h * q + 2 * h * kv + q * h + 2 * 128
    layer = attention + 4 * h + 3 * h * 21504  # four norms (sandwich), the MLP
    total = layers * layer + vocab * h + h  # tied embeddings
    assert p["parameters"] == p["active_parameters"] == total and round(total / 1e9) == 27
    per_layer = 2 * 16 * 128 * 2
    assert p["kv_groups"] == [group("full", None, 10, 1, 10 * per_layer),
                              group("sliding", 1024, 52, 6, 52 * per_layer)]
    assert p["kv_bytes_per_token"] == 62 * per_layer
    # 8k tokens: 512 blocks of the full group, 1024 / 16 + 1 of each of six sliding groups, 10 layers each
    assert p["kv_block_slots"] == 10 and p["blocks_per_sequence"] == 512 + 6 * 65
    full_attention_layer_blocks = 62 * 512
    assert p["blocks_per_sequence"] * 10 < full_attention_layer_blocks / 3.4


def test_plan_prints_the_groups(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(GEMMA3_27B))
    assert main(["plan", str(path)]) == 0
    out = capsys.readouterr().out
    assert "sliding layers (window 1,024)" in out
    assert "52 layers in 6 KV groups: 425,984 bytes per token" in out
    assert "full layers" in out and "16 tokens x 10 layers = 1,310,720 bytes\n" in out


DEEPSEEK_V3 = json.loads("""{"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
 "attention_bias": false, "first_k_dense_replace": 3, "hidden_act": "silu", "hidden_size": 7168,
 "intermediate_size": 18432, "kv_lora_rank": 512, "max_position_embeddings": 163840,
 "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256,
 "n_shared_experts": 1, "norm_topk_prob": true,
 "num_attention_heads": 128, "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 128,
 "num_nextn_predict_layers": 1, "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
 "rms_norm_eps": 1e-06, "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
 "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096, "type": "yarn"}, "rope_theta": 10000,
 "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "tie_word_embeddings": false, "topk_group": 4,
 "topk_method": "noaux_tc", "v_head_dim": 128, "vocab_size": 129280}""")  # deepseek-ai/DeepSeek-V3


def test_deepseek_v3_latent_cache(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = plan(tmp_path, capsys, DEEPSEEK_V3)
    assert p["kv_bytes_per_token"] == 61 * (512 + 64) * 2 == 70_272  # one latent row, no heads
    assert p["latent_dim"] == 576 and p["kv_groups"] == [group("full", None, 61, 1, 70_272)]
    fp8 = plan(tmp_path, capsys, DEEPSEEK_V3, "--kv-cache-dtype", "fp8")
    assert fp8["kv_bytes_per_token"] == 35_136
    assert fp8["kv_block_bytes"] == 16 * 35_136 + 61 * 4  # one float32 scale per layer's block
    h, heads = 7168, 128
    attention = (1536 * h + 1536 + heads * 192 * 1536  # query LoRA, its norm, up-projection
                 + 576 * h + 512 + heads * (128 + 128) * 512 + h * heads * 128)  # latent, kv_b, o
    routed = 3 * h * 2048
    moe_layer = attention + 2 * h + 256 * h + 256 + routed  # router, correction bias, one shared expert
    total = 3 * (attention + 2 * h + 3 * h * 18432) + 58 * (moe_layer + 256 * routed) + 2 * 129280 * h + h
    active = total - 58 * (256 - 8) * routed
    assert p["parameters"] == total and round(total / 1e9) == 671
    assert p["active_parameters"] == active and round(active / 1e9) == 38  # DeepSeek's "37B activated"
    # 8 x 80 GiB at TP 8: the bf16 weights alone (~158 GiB a device) leave no room for KV
    tp8 = plan(tmp_path, capsys, DEEPSEEK_V3, "--tensor-parallel-size", "8", "--device-memory", "80G")
    assert tp8["weight_bytes"] > 0.9 * 80 * 1024**3 and tp8["kv_tokens"] == 0
    # with the fp8 checkpoint's bytes (--weight-memory) on 8 x 141 GiB: the latent is replicated on every
    # rank, so each device holds every layer's 576 values per token
    h200 = plan(tmp_path, capsys, DEEPSEEK_V3, "--tensor-parallel-size", "8", "--device-memory", "141G",
                "--weight-memory", "671G", "--kv-cache-dtype", "fp8")
    budget = int(141 * 1024**3 * 0.9) - 671 * 1024**3 // 8
    assert h200["kv_budget_bytes"] == budget
    assert h200["kv_tokens"] == budget // (16 * 35_136 + 244) * 16

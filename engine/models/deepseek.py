"""DeepSeek-V2 and -V3: multi-head latent attention and a mixture of experts with shared experts.

Attention is MLA (``engine/layers/mla.py``): one latent row per token per layer in the cache
(``MlaConfig.latent_dim``: ``kv_lora_rank`` plus the shared rotary key), queries from ``q_proj`` (V2,
V2-Lite) or a LoRA of ``q_lora_rank`` (V2, V3). The first ``first_k_dense_replace`` layers keep a dense
MLP; the others route among ``n_routed_experts`` (V2: the top k of a softmax, group-limited when
``topk_method`` says so; V3: sigmoid scores chosen by group with the correction bias, renormalised
when ``norm_topk_prob``), weights times ``routed_scaling_factor``, plus ``n_shared_experts`` shared
experts as one dense MLP. YaRN's ``mscale_all_dim`` scales the softmax by its square, as DeepSeek does.
V3's multi-token-prediction layers (past ``num_hidden_layers``) are not loaded.

GGUF: llama.cpp writes both as ``deepseek2``. Its keys give the latent (``attention.kv_lora_rank``,
``attention.q_lora_rank`` when there is a query LoRA, ``rope.dimension_count`` for the rotary part, and
the per-head key and value widths as ``attention.key_length_mla``/``value_length_mla``, or, in files
written before those keys, as ``key_length``/``value_length``), the experts
(``leading_dense_block_count``, ``expert_shared_count``, ``expert_weights_scale`` for
``routed_scaling_factor``, ``expert_weights_norm``, ``expert_group_count``/``expert_group_used_count``)
and YaRN's ``rope.scaling.yarn_log_multiplier`` (``0.1 * mscale_all_dim``). ``expert_gating_func``
sigmoid (2) is DeepSeek-V3 (its correction bias is ``exp_probs_b``); softmax, or none (V2 files predate
the key), is V2. The converter splits ``kv_b_proj`` per head into ``attn_k_b`` (the key half,
transposed: ``[heads, kv_lora_rank, qk_nope_head_dim]``) and ``attn_v_b`` (``[heads, v_head_dim,
kv_lora_rank]``); ``merge_kv_b`` joins them back (older files keep ``attn_kv_b`` whole).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from engine.config import MlaConfig, ModelConfig, MoeConfig, RopeScaling
from engine.gguf_file import GGUFFile
from engine.models import gguf_config
from engine.models.family import ModelFamily, Weights
from engine.models.gguf_config import GgufFormat, Named, integer, number
from engine.models.hf_config import base_fields, required, rope_parameters

_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def _scale(raw: dict[str, Any], qk_head_dim: int) -> float:
    """The softmax scale: ``qk_head_dim ** -0.5``, times YaRN's mscale squared."""
    scale = qk_head_dim**-0.5
    params = rope_parameters(raw)
    if params.get("rope_type", params.get("type", "default")) != "default" and params.get("mscale_all_dim"):
        factor = float(params["factor"])
        mscale = 0.1 * float(params["mscale_all_dim"]) * math.log(factor) + 1.0 if factor > 1 else 1.0
        scale *= mscale * mscale
    return scale


def _deepseek_config(raw: dict[str, Any], source: Path, architecture: str) -> ModelConfig:
    if raw.get("attention_bias"):
        raise ValueError(f"attention biases in {source} are not supported for {architecture}")
    fields = base_fields(raw, source, architecture, 163840 if architecture == "deepseek_v3" else 2048)
    mla = MlaConfig(kv_lora_rank=required(raw, "kv_lora_rank", source),
                    qk_nope_head_dim=required(raw, "qk_nope_head_dim", source),
                    qk_rope_head_dim=required(raw, "qk_rope_head_dim", source),
                    v_head_dim=required(raw, "v_head_dim", source),
                    q_lora_rank=int(raw["q_lora_rank"]) if raw.get("q_lora_rank") else None,
                    rope_interleave=bool(raw.get("rope_interleave", True)) if architecture == "deepseek_v3"
                    else True)
    v3 = architecture == "deepseek_v3"
    grouped = v3 or raw.get("topk_method") == "group_limited_greedy"
    shared = int(raw.get("moe_intermediate_size") or 0) * int(raw.get("n_shared_experts") or 0)
    moe = MoeConfig(
        num_experts=required(raw, "n_routed_experts", source),
        top_k=required(raw, "num_experts_per_tok", source),
        intermediate_size=required(raw, "moe_intermediate_size", source),
        router="sigmoid_group_topk" if v3 else "softmax_group_topk" if grouped else "softmax_topk",
        renormalize=bool(raw.get("norm_topk_prob", True)) if v3 else False,
        n_group=int(raw.get("n_group") or 1) if grouped else 1,
        topk_group=int(raw.get("topk_group") or 1) if grouped else 1,
        routed_scaling_factor=float(raw.get("routed_scaling_factor") or 1.0), correction_bias=v3,
        shared_intermediate_size=shared,
        dense_layers=tuple(range(min(int(raw.get("first_k_dense_replace") or 0), fields["num_layers"]))))
    fields |= {"num_kv_heads": 1, "head_dim": mla.qk_head_dim}
    return ModelConfig(**fields, mla=mla, moe=moe, attention_scale=_scale(raw, mla.qk_head_dim))


def deepseek_v2_config(raw: dict[str, Any], source: Path) -> ModelConfig:
    return _deepseek_config(raw, source, "deepseek_v2")


def deepseek_v3_config(raw: dict[str, Any], source: Path) -> ModelConfig:
    return _deepseek_config(raw, source, "deepseek_v3")


def deepseek_names(weights: Weights, config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint as it is, less the multi-token-prediction layers past the model's (kept blocks and
    codes pass through as they come)."""
    for name, tensor in weights:
        match = _LAYER.match(name)
        if match is None or int(match.group(1)) < config.num_layers:
            yield name, tensor


SIGMOID_GATING = 2  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID
DEEPSEEK2_LAYERS = {
    "attn_norm": "input_layernorm.{kind}",
    "attn_q": "self_attn.q_proj.{kind}",
    "attn_q_a": "self_attn.q_a_proj.{kind}",
    "attn_q_a_norm": "self_attn.q_a_layernorm.{kind}",
    "attn_q_b": "self_attn.q_b_proj.{kind}",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa.{kind}",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm.{kind}",
    "attn_kv_b": "self_attn.kv_b_proj.{kind}",
    "attn_k_b": "self_attn.k_b_proj.{kind}",  # joined into kv_b_proj by merge_kv_b
    "attn_v_b": "self_attn.v_b_proj.{kind}",
    "attn_output": "self_attn.o_proj.{kind}",
    "ffn_norm": "post_attention_layernorm.{kind}",
    "ffn_gate": "mlp.gate_proj.{kind}",
    "ffn_up": "mlp.up_proj.{kind}",
    "ffn_down": "mlp.down_proj.{kind}",
    "ffn_gate_inp": "mlp.gate.{kind}",
    "exp_probs_b": "mlp.gate.e_score_correction_{kind}",
    "ffn_gate_exps": "mlp.experts.{expert}.gate_proj.{kind}",
    "ffn_up_exps": "mlp.experts.{expert}.up_proj.{kind}",
    "ffn_down_exps": "mlp.experts.{expert}.down_proj.{kind}",
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj.{kind}",
    "ffn_up_shexp": "mlp.shared_experts.up_proj.{kind}",
    "ffn_down_shexp": "mlp.shared_experts.down_proj.{kind}",
}


def _sigmoid_gating(reader: GGUFFile) -> bool:
    return reader.fields.get("deepseek2.expert_gating_func") == SIGMOID_GATING


def deepseek2_gguf_config(reader: GGUFFile, path: Path) -> ModelConfig:
    """A ``deepseek2`` file's config (see the module docstring)."""
    v3 = _sigmoid_gating(reader)
    fields = gguf_config.base_fields(reader, path, "deepseek_v3" if v3 else "deepseek_v2", partial_rope=True)

    def count(key: str, default: int | None = None) -> int:
        return integer(reader, f"deepseek2.{key}", path, default)

    rope = count("rope.dimension_count")
    qk_head_dim = count("attention.key_length_mla", 0) or count("attention.key_length")
    mla = MlaConfig(kv_lora_rank=count("attention.kv_lora_rank"), qk_nope_head_dim=qk_head_dim - rope,
                    qk_rope_head_dim=rope,
                    v_head_dim=count("attention.value_length_mla", 0) or count("attention.value_length"),
                    q_lora_rank=count("attention.q_lora_rank", 0) or None, rope_interleave=True)
    groups = count("expert_group_count", 1)
    grouped = v3 or groups > 1
    expert_size = count("expert_feed_forward_length")
    dense = min(count("leading_dense_block_count", 0), fields["num_layers"])
    moe = MoeConfig(
        num_experts=count("expert_count"), top_k=count("expert_used_count"), intermediate_size=expert_size,
        router="sigmoid_group_topk" if v3 else "softmax_group_topk" if grouped else "softmax_topk",
        renormalize=bool(reader.fields.get("deepseek2.expert_weights_norm", False)) if v3 else False,
        n_group=groups if grouped else 1, topk_group=count("expert_group_used_count", 1) if grouped else 1,
        routed_scaling_factor=number(reader, "deepseek2.expert_weights_scale", path, 1.0) or 1.0,
        correction_bias=v3, shared_intermediate_size=expert_size * count("expert_shared_count", 0),
        dense_layers=tuple(range(dense)))
    scaling: RopeScaling = fields["rope_scaling"]
    scale = mla.qk_head_dim**-0.5
    log_mul = number(reader, "deepseek2.rope.scaling.yarn_log_multiplier", path)
    if scaling.rope_type == "yarn" and log_mul:
        # DeepSeek's mscale == mscale_all_dim (the cos/sin factor 1), the softmax scaled by its square
        all_dim = float(f"{10 * log_mul:.6g}")
        fields["rope_scaling"] = dataclasses.replace(scaling, mscale=all_dim, mscale_all_dim=all_dim)
        mscale = log_mul * math.log(scaling.factor) + 1.0 if scaling.factor > 1 else 1.0
        scale *= mscale * mscale
    fields |= {"num_kv_heads": 1, "head_dim": mla.qk_head_dim}
    return ModelConfig(**fields, mla=mla, moe=moe, attention_scale=scale)


def merge_kv_b(tensors: Named, config: ModelConfig) -> Named:
    """``attn_k_b`` and ``attn_v_b`` of each layer joined back into its ``kv_b_proj`` (rows per head: the
    key's ``qk_nope_head_dim``, then the value's ``v_head_dim``); the rest as it comes."""
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors:
        if not name.endswith(("self_attn.k_b_proj.weight", "self_attn.v_b_proj.weight")):
            yield name, tensor
            continue
        prefix, part, _ = name.rsplit(".", 2)
        pair = halves.setdefault(prefix, {})
        pair[part] = tensor
        if len(pair) == 2:
            del halves[prefix]
            k_b = pair["k_b_proj"].transpose(1, 2)  # [heads, rank, nope] -> [heads, nope, rank]
            joined = torch.cat((k_b, pair["v_b_proj"]), dim=1)  # v_b: [heads, v, rank]
            yield f"{prefix}.kv_b_proj.weight", joined.reshape(-1, joined.shape[2]).contiguous()
    if halves:
        raise ValueError(f"GGUF file has only one of attn_k_b and attn_v_b for {', '.join(sorted(halves))}")


DEEPSEEK_V2 = ModelFamily("deepseek_v2", "DeepSeek-V2, V2-Lite", ("DeepseekV2ForCausalLM",), ("deepseek_v2",),
                          deepseek_v2_config, canonical=deepseek_names, canonical_keeps_blocks=True,
                          gguf_architectures=("deepseek2",),
                          gguf=GgufFormat(deepseek2_gguf_config, DEEPSEEK2_LAYERS, merge=merge_kv_b,
                                          accepts=lambda reader: not _sigmoid_gating(reader)))
DEEPSEEK_V3 = ModelFamily("deepseek_v3", "DeepSeek-V3, R1", ("DeepseekV3ForCausalLM",), ("deepseek_v3",),
                          deepseek_v3_config, canonical=deepseek_names, canonical_keeps_blocks=True,
                          gguf_architectures=("deepseek2",),
                          gguf=GgufFormat(deepseek2_gguf_config, DEEPSEEK2_LAYERS, merge=merge_kv_b,
                                          accepts=_sigmoid_gating))

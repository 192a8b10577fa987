"""DeepSeek-V2 and -V3: multi-head latent attention and a mixture of experts with shared experts.

Attention is MLA (``engine/layers/mla.py``): one latent row per token per layer in the cache
(``MlaConfig.latent_dim``: ``kv_lora_rank`` plus the shared rotary key), queries from ``q_proj`` (V2,
V2-Lite) or a LoRA of ``q_lora_rank`` (V2, V3). The first ``first_k_dense_replace`` layers keep a dense
MLP; the others route among ``n_routed_experts`` (V2: the top k of a softmax, group-limited when
``topk_method`` says so; V3: sigmoid scores chosen by group with the correction bias, renormalised
when ``norm_topk_prob``), weights times ``routed_scaling_factor``, plus ``n_shared_experts`` shared
experts as one dense MLP. YaRN's ``mscale_all_dim`` scales the softmax by its square, as DeepSeek does.
V3's multi-token-prediction layers (past ``num_hidden_layers``) are not loaded.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from engine.config import MlaConfig, ModelConfig, MoeConfig
from engine.models.family import ModelFamily, Weights
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
    """The checkpoint as it is, less the multi-token-prediction layers past the model's."""
    for name, tensor in weights:
        match = _LAYER.match(name)
        if match is None or int(match.group(1)) < config.num_layers:
            yield name, tensor


DEEPSEEK_V2 = ModelFamily("deepseek_v2", "DeepSeek-V2, V2-Lite", ("DeepseekV2ForCausalLM",), ("deepseek_v2",),
                          deepseek_v2_config, canonical=deepseek_names)
DEEPSEEK_V3 = ModelFamily("deepseek_v3", "DeepSeek-V3, R1", ("DeepseekV3ForCausalLM",), ("deepseek_v3",),
                          deepseek_v3_config, canonical=deepseek_names)

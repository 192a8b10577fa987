"""Qwen3 (dense) and Qwen3-MoE: Llama's layers with an RMSNorm over each query and key head.

Qwen3-MoE's MLP is a mixture of ``num_experts`` experts of ``moe_intermediate_size`` with the top
``num_experts_per_tok`` of a softmax (renormalised when ``norm_topk_prob``); layers listed in
``mlp_only_layers``, or off the ``decoder_sparse_step`` grid, keep a dense MLP.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engine.config import ModelConfig, MoeConfig
from engine.gguf_file import GGUFFile
from engine.models import gguf_config
from engine.models.family import ModelFamily
from engine.models.gguf_config import GgufFormat
from engine.models.hf_config import base_fields, required
from engine.models.llama import qwen_windows


def qwen3_config(raw: dict[str, Any], source: Path) -> ModelConfig:
    fields = base_fields(raw, source, "qwen3", 40960)
    return ModelConfig(**fields, qk_norm=True, **qwen_windows(raw, fields["num_layers"]))


def qwen3_moe_config(raw: dict[str, Any], source: Path) -> ModelConfig:
    fields = base_fields(raw, source, "qwen3_moe", 40960)
    layers = fields["num_layers"]
    step = int(raw.get("decoder_sparse_step") or 1)
    only = {int(i) for i in raw.get("mlp_only_layers") or []}
    dense = tuple(i for i in range(layers) if i in only or (i + 1) % step)
    experts = raw.get("num_experts") or raw.get("num_local_experts")
    if experts is None:
        raise ValueError(f"missing required field 'num_experts' in {source}")
    moe = MoeConfig(num_experts=int(experts),
                    top_k=required(raw, "num_experts_per_tok", source),
                    intermediate_size=required(raw, "moe_intermediate_size", source),
                    renormalize=bool(raw.get("norm_topk_prob", False)), dense_layers=dense)
    return ModelConfig(**fields, qk_norm=True, moe=moe, **qwen_windows(raw, layers))


def qwen3_gguf_config(reader: GGUFFile, path: Path) -> ModelConfig:
    return ModelConfig(**gguf_config.base_fields(reader, path, "qwen3"), qk_norm=True)


def qwen3_moe_gguf_config(reader: GGUFFile, path: Path) -> ModelConfig:
    """llama.cpp's ``qwen3moe``: every layer's router renormalised (llama.cpp always renormalises
    Qwen3-MoE's top k; ``qwen3moe.expert_weights_norm`` may say otherwise). A layer without a router
    (``ffn_gate_inp``) keeps a dense MLP under llama.cpp's dense names (``mlp_only_layers``; llama.cpp
    itself loads no such file)."""
    fields = gguf_config.base_fields(reader, path, "qwen3_moe")
    layers = fields["num_layers"]
    moe = MoeConfig(**gguf_config.expert_counts(reader, path, fields["intermediate_size"]),
                    renormalize=bool(reader.fields.get("qwen3moe.expert_weights_norm", True)),
                    dense_layers=gguf_config.dense_layers(reader, layers))
    return ModelConfig(**fields, qk_norm=True, moe=moe)


QWEN3 = ModelFamily("qwen3", "Qwen3 (dense)", ("Qwen3ForCausalLM",), ("qwen3",), qwen3_config,
                    gguf_architectures=("qwen3",), gguf=GgufFormat(qwen3_gguf_config))
QWEN3_MOE = ModelFamily("qwen3_moe", "Qwen3-MoE", ("Qwen3MoeForCausalLM",), ("qwen3_moe",), qwen3_moe_config,
                        gguf_architectures=("qwen3moe",), gguf=GgufFormat(qwen3_moe_gguf_config))

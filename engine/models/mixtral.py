"""Mixtral: Llama's attention with a mixture of experts (top k of a softmax, renormalised).

Checkpoints name the MLP ``block_sparse_moe`` and each expert's products ``w1`` (gate), ``w3`` (up)
and ``w2`` (down); ``canonical`` renames them to the layer library's names.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from engine.config import ModelConfig, MoeConfig
from engine.gguf_file import GGUFFile
from engine.models import gguf_config
from engine.models.family import ModelFamily, Weights
from engine.models.gguf_config import GgufFormat, llama_qk
from engine.models.hf_config import base_fields, layer_types, required

_EXPERT = re.compile(r"(.*)\.block_sparse_moe\.experts\.(\d+)\.w([123])\.(weight|bias)")
_PRODUCT = {"1": "gate_proj", "2": "down_proj", "3": "up_proj"}


def mixtral_config(raw: dict[str, Any], source: Path) -> ModelConfig:
    fields = base_fields(raw, source, "mixtral", 131072)
    layers = fields["num_layers"]
    window = raw.get("sliding_window")
    moe = MoeConfig(num_experts=required(raw, "num_local_experts", source),
                    top_k=required(raw, "num_experts_per_tok", source),
                    intermediate_size=fields["intermediate_size"])
    return ModelConfig(**fields, moe=moe, sliding_window=window,
                       layer_types=layer_types(raw, layers, [window is not None] * layers))


def mixtral_names(weights: Weights, config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in weights:
        match = _EXPERT.fullmatch(name)
        if match is not None:
            prefix, expert, product, kind = match.groups()
            yield f"{prefix}.mlp.experts.{expert}.{_PRODUCT[product]}.{kind}", tensor
        else:
            yield name.replace(".block_sparse_moe.", ".mlp."), tensor


def mixtral_gguf_config(reader: GGUFFile, path: Path) -> ModelConfig:
    """llama.cpp writes Mixtral as ``llama`` with experts (``llama.expert_count``; the experts' size is
    the dense ``feed_forward_length``), Q/K permuted like Llama's, and without its sliding window."""
    fields = gguf_config.base_fields(reader, path, "mixtral")
    return ModelConfig(**fields, moe=MoeConfig(**gguf_config.expert_counts(reader, path,
                                                                           fields["intermediate_size"])))


def llama_with_experts(reader: GGUFFile) -> bool:
    return bool(reader.fields.get("llama.expert_count"))


MIXTRAL = ModelFamily("mixtral", "Mixtral", ("MixtralForCausalLM",), ("mixtral",), mixtral_config,
                      canonical=mixtral_names, canonical_keeps_blocks=True, gguf_architectures=("llama",),
                      gguf=GgufFormat(mixtral_gguf_config, fix=llama_qk, accepts=llama_with_experts))

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
from engine.models.family import ModelFamily, Weights
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


MIXTRAL = ModelFamily("mixtral", "Mixtral", ("MixtralForCausalLM",), ("mixtral",), mixtral_config,
                      canonical=mixtral_names)

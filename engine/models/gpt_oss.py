"""gpt-oss: a mixture of experts with biases and a clamped SwiGLU, attention sinks, alternating windows.

Every layer's MLP is the mixture: the router (with a bias) takes the top k logits, then their softmax;
each expert's products have biases and its activation is ``(up + 1) * gate * sigmoid(alpha * gate)``
with gate and up clamped to ``swiglu_limit``. Attention has q/k/v/o biases, one learned sink logit per
query head, and alternates sliding-window and full layers (``layer_types``); rope is YaRN.

Checkpoints store the experts fused: ``mlp.experts.gate_up_proj`` ``[E, hidden, 2I]`` with gate and up
interleaved along the last dimension, ``down_proj`` ``[E, I, hidden]`` (both input-major), their biases,
and the router as ``mlp.router``; ``canonical`` splits and transposes them into the layer library's
per-expert ``[out, in]`` matrices. MXFP4-quantized experts (``*_blocks`` / ``*_scales``) arrive
dequantized, or as Q5_0 rows of the same values where the model keeps them, when ``quantization_config``
names mxfp4 (``engine/checkpoint_quant.py``); without it they are refused.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, cast

from engine.config import ModelConfig, MoeConfig
from engine.gguf_file import GGUFFile
from engine.models import gguf_config
from engine.models.family import ModelFamily, Weights
from engine.models.gguf_config import LLAMA_LAYERS, GgufFormat
from engine.models.hf_config import base_fields, layer_types, required
from kernels.gguf_blocks import BlockStack


def gpt_oss_config(raw: dict[str, Any], source: Path) -> ModelConfig:
    fields = base_fields(raw, source, "gpt_oss", 131072)
    top_k = raw.get("num_experts_per_tok") or raw.get("experts_per_token")
    if top_k is None:
        raise ValueError(f"missing required field 'num_experts_per_tok' in {source}")
    moe = MoeConfig(num_experts=required(raw, "num_local_experts", source), top_k=int(top_k),
                    intermediate_size=fields["intermediate_size"], router="topk_softmax", router_bias=True,
                    expert_bias=True, activation="swiglu_oai",
                    swiglu_alpha=float(raw.get("swiglu_alpha", 1.702)),
                    swiglu_limit=float(raw.get("swiglu_limit", 7.0)))
    kinds = layer_types(raw, fields["num_layers"])
    return ModelConfig(**fields, moe=moe, attention_sinks=True, o_proj_bias=fields["attention_bias"],
                       layer_types=kinds, sliding_window=raw.get("sliding_window") if kinds else None)


def gpt_oss_names(weights: Weights, config: ModelConfig) -> Iterator[tuple[str, Any]]:
    """The layer library's names and layouts; MXFP4 experts kept as Q5_0 rows (a ``BlockStack``,
    ``engine/checkpoint_quant.py``) split per expert into ``BlockMatrix`` rows the same way."""
    for name, tensor in cast(Iterable[tuple[str, Any]], weights):
        if name.endswith(("_blocks", "_scales")):
            raise ValueError(f"{name}: MXFP4 experts in a checkpoint whose config.json has no "
                             f"quantization_config naming mxfp4")
        prefix, _, last = name.rpartition(".mlp.")
        if not prefix:
            yield name, tensor
        elif last.startswith("router."):
            yield f"{prefix}.mlp.gate.{last.removeprefix('router.')}", tensor
        elif last == "experts.gate_up_proj" and isinstance(tensor, BlockStack):  # [E][2I, hidden] rows
            for e, rows in enumerate(tensor.experts):
                p = f"{prefix}.mlp.experts.{e}"
                yield f"{p}.gate_proj.weight", rows.with_rows(rows.rows[0::2].contiguous())
                yield f"{p}.up_proj.weight", rows.with_rows(rows.rows[1::2].contiguous())
        elif last == "experts.down_proj" and isinstance(tensor, BlockStack):  # [E][hidden, I] rows
            for e, rows in enumerate(tensor.experts):
                yield f"{prefix}.mlp.experts.{e}.down_proj.weight", rows
        elif last == "experts.gate_up_proj":  # [E, hidden, 2I], gate and up interleaved
            for e in range(tensor.shape[0]):
                yield f"{prefix}.mlp.experts.{e}.gate_proj.weight", tensor[e, :, 0::2].t().contiguous()
                yield f"{prefix}.mlp.experts.{e}.up_proj.weight", tensor[e, :, 1::2].t().contiguous()
        elif last == "experts.gate_up_proj_bias":
            for e in range(tensor.shape[0]):
                yield f"{prefix}.mlp.experts.{e}.gate_proj.bias", tensor[e, 0::2].contiguous()
                yield f"{prefix}.mlp.experts.{e}.up_proj.bias", tensor[e, 1::2].contiguous()
        elif last == "experts.down_proj":  # [E, I, hidden]
            for e in range(tensor.shape[0]):
                yield f"{prefix}.mlp.experts.{e}.down_proj.weight", tensor[e].t().contiguous()
        elif last == "experts.down_proj_bias":
            for e in range(tensor.shape[0]):
                yield f"{prefix}.mlp.experts.{e}.down_proj.bias", tensor[e]
        else:
            yield name, tensor


GPT_OSS_GGUF_LAYERS = {**LLAMA_LAYERS, "post_attention_norm": "post_attention_layernorm.{kind}",
                       "attn_sinks": "self_attn.sinks"}


def gpt_oss_gguf_config(reader: GGUFFile, path: Path) -> ModelConfig:
    """llama.cpp's ``gpt-oss``: sliding layers in a period of 2 (the first of each pair) unless
    ``sliding_window_pattern`` says otherwise; experts stored per product (the converter de-interleaves
    gate and up), ``[out, in]``, MXFP4 or not (``gguf`` dequantizes MXFP4 like any other type); YaRN
    without rounding its correction range (``truncate`` false, as gpt-oss's reference and every gpt-oss
    config compute it; llama.cpp rounds it)."""
    fields = gguf_config.base_fields(reader, path, "gpt_oss")
    if fields["rope_scaling"].rope_type == "yarn":
        fields["rope_scaling"] = dataclasses.replace(fields["rope_scaling"], truncate=False)
    moe = MoeConfig(**gguf_config.expert_counts(reader, path, fields["intermediate_size"]),
                    router="topk_softmax", router_bias=True, expert_bias=True, activation="swiglu_oai")
    o_bias = gguf_config.has_tensor(reader, "blk.0.attn_output.bias")
    return ModelConfig(**fields, **gguf_config.sliding_layers(reader, path, fields["num_layers"], 2), moe=moe,
                       attention_sinks=True, o_proj_bias=o_bias)


GPT_OSS = ModelFamily("gpt_oss", "gpt-oss", ("GptOssForCausalLM",), ("gpt_oss",), gpt_oss_config,
                      canonical=gpt_oss_names, canonical_keeps_blocks=True, gguf_architectures=("gpt-oss",),
                      gguf=GgufFormat(gpt_oss_gguf_config, GPT_OSS_GGUF_LAYERS))

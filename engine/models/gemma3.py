"""Gemma 3 (text): sandwich norms, ``1 + w`` RMSNorms, scaled embeddings, tanh-GELU, and local layers.

Five of every six layers (``sliding_window_pattern``, or the config's ``layer_types``) attend to a
``sliding_window`` of recent tokens with their own rope base (``rope_local_base_freq``, no scaling);
the others attend to everything with ``rope_theta`` and the config's rope scaling. The softmax scale
is ``query_pre_attn_scalar ** -0.5``; q and k are RMSNormed per head; the final logits may be
soft-capped (``final_logit_softcapping``). ``attn_logit_softcapping`` is not applied: Gemma 3 computes
attention without it (as transformers does; every published Gemma 3 config sets it to null). Both
config spellings are read: transformers' per-layer-type ``rope_parameters`` and the older
``rope_theta`` / ``rope_local_base_freq`` / ``rope_scaling``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engine.config import FULL_ATTENTION, SLIDING_ATTENTION, ModelConfig, RopeScaling
from engine.gguf_file import GGUFFile
from engine.models import gguf_config
from engine.models.family import ModelFamily
from engine.models.gguf_config import LLAMA_LAYERS, GgufFormat, norm_minus_one
from engine.models.hf_config import base_fields, layer_types, parse_rope

_ACTIVATIONS = {"gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu_tanh", "silu": "silu"}


def gemma3_config(raw: dict[str, Any], source: Path) -> ModelConfig:
    raw = {"tie_word_embeddings": True, "head_dim": 256, **raw}
    fields = base_fields(raw, source, "gemma3", 131072)
    layers = fields["num_layers"]
    pattern = int(raw.get("sliding_window_pattern") or raw.get("_sliding_window_pattern") or 6)
    kinds = layer_types(raw, layers, [bool((i + 1) % pattern) for i in range(layers)])
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and FULL_ATTENTION in params:  # one set per layer type
        theta, scaling = parse_rope(params.get(FULL_ATTENTION) or {}, 1_000_000.0, source)
        local_theta, local = parse_rope(params.get(SLIDING_ATTENTION) or {}, 10_000.0, source)
    else:
        theta, scaling = parse_rope(raw.get("rope_scaling") or {}, float(raw.get("rope_theta", 1_000_000.0)),
                                    source)
        local_theta, local = float(raw.get("rope_local_base_freq", 10_000.0)), RopeScaling()
    if local.rope_type != "default":
        raise ValueError(f"unsupported rope scaling {local.rope_type!r} for the sliding layers in {source}")
    act = str(raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh")
    if act not in _ACTIVATIONS:
        raise ValueError(f"unsupported hidden activation {act!r} in {source}; "
                         f"supported: {', '.join(_ACTIVATIONS)}")
    scalar = raw.get("query_pre_attn_scalar") or fields["head_dim"]
    fields |= {"rope_theta": theta, "rope_scaling": scaling}
    return ModelConfig(
        **fields, layer_types=kinds, sliding_window=raw.get("sliding_window") if kinds else None,
        qk_norm=True, attention_scale=float(scalar) ** -0.5,
        final_logit_softcap=raw.get("final_logit_softcapping"), local_rope_theta=local_theta,
        hidden_act=_ACTIVATIONS[act])


# llama.cpp's names for Gemma's four norms: ``ffn_norm`` is the pre-feed-forward one here
GEMMA3_GGUF_LAYERS = {**LLAMA_LAYERS, "post_attention_norm": "post_attention_layernorm.{kind}",
                      "ffn_norm": "pre_feedforward_layernorm.{kind}",
                      "post_ffw_norm": "post_feedforward_layernorm.{kind}"}
GEMMA3_27B_LAYERS = 62


def gemma3_gguf_config(reader: GGUFFile, path: Path) -> ModelConfig:
    """llama.cpp's ``gemma3``: local layers of ``gemma3.attention.sliding_window`` in a period of
    ``sliding_window_pattern`` (6 when absent), their rope base ``rope.freq_base_swa`` (10000 when
    absent). No key carries ``query_pre_attn_scalar``: the softmax scale is ``gemma3.attention.scale``
    when the file has one, else llama.cpp's rule, ``head_dim ** -0.5`` (``(hidden / heads) ** -0.5``
    for Gemma 3 27B, 62 layers), which is every published Gemma 3's ``query_pre_attn_scalar ** -0.5``."""
    fields = gguf_config.base_fields(reader, path, "gemma3")
    layers = fields["num_layers"]
    scale = gguf_config.number(reader, "gemma3.attention.scale", path)
    if scale is None:
        wide = layers == GEMMA3_27B_LAYERS
        scale = float(fields["hidden_size"] / fields["num_heads"] if wide else fields["head_dim"]) ** -0.5
    return ModelConfig(
        **fields, **gguf_config.sliding_layers(reader, path, layers, 6), qk_norm=True, attention_scale=scale,
        final_logit_softcap=gguf_config.number(reader, "gemma3.final_logit_softcapping", path) or None,
        local_rope_theta=gguf_config.number(reader, "gemma3.rope.freq_base_swa", path, 10_000.0),
        hidden_act="gelu_tanh")


GEMMA3 = ModelFamily("gemma3", "Gemma 3 (text)", ("Gemma3ForCausalLM",), ("gemma3_text",), gemma3_config,
                     norm_offset=True, sandwich_norms=True, embed_scale=True, gguf_architectures=("gemma3",),
                     gguf=GgufFormat(gemma3_gguf_config, GEMMA3_GGUF_LAYERS, fix=norm_minus_one))

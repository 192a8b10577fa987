"""The Llama family: Llama 2/3, SmolLM2, Mistral and Qwen2 (pre-norm, SiLU MLP, GQA, rope).

Mistral's ``sliding_window`` makes every layer a sliding-window layer; Qwen2 has QKV biases and,
with ``use_sliding_window``, sliding layers from ``max_window_layers`` on.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engine.config import ModelConfig
from engine.gguf_file import GGUFFile
from engine.models import gguf_config
from engine.models.family import ModelFamily
from engine.models.gguf_config import GgufFormat, llama_qk
from engine.models.hf_config import base_fields, layer_types


def llama_config(raw: dict[str, Any], source: Path) -> ModelConfig:
    return ModelConfig(**base_fields(raw, source, "llama", 2048))


def mistral_config(raw: dict[str, Any], source: Path) -> ModelConfig:
    fields = base_fields(raw, source, "mistral", 131072)
    window = raw.get("sliding_window")
    layers = fields["num_layers"]
    return ModelConfig(**fields, sliding_window=window,
                       layer_types=layer_types(raw, layers, [window is not None] * layers))


def qwen2_config(raw: dict[str, Any], source: Path) -> ModelConfig:
    fields = base_fields(raw, source, "qwen2", 32768)
    fields["attention_bias"] = True
    return ModelConfig(**fields, **qwen_windows(raw, fields["num_layers"]))


def qwen_windows(raw: dict[str, Any], layers: int) -> dict[str, Any]:
    """Qwen's sliding layers: with ``use_sliding_window``, layers from ``max_window_layers`` on."""
    window = raw.get("sliding_window") if raw.get("use_sliding_window") else None
    first = int(raw.get("max_window_layers") or 0)
    kinds = layer_types(raw, layers, [window is not None and i >= first for i in range(layers)])
    return {"sliding_window": window if kinds else None, "layer_types": kinds}


def llama_gguf_config(reader: GGUFFile, path: Path) -> ModelConfig:
    """A ``llama``-arch GGUF without experts (Llama, and Mistral, which llama.cpp writes as ``llama``
    without its window)."""
    return ModelConfig(**gguf_config.base_fields(reader, path, "llama"))


def qwen2_gguf_config(reader: GGUFFile, path: Path) -> ModelConfig:
    return ModelConfig(**gguf_config.base_fields(reader, path, "qwen2"))


def dense_llama(reader: GGUFFile) -> bool:
    """Whether a ``llama``-arch GGUF is dense (one with experts is Mixtral's)."""
    return not reader.fields.get("llama.expert_count")


LLAMA = ModelFamily("llama", "Llama 2/3, SmolLM2", ("LlamaForCausalLM",), ("llama",), llama_config,
                    gguf_architectures=("llama",),
                    gguf=GgufFormat(llama_gguf_config, fix=llama_qk, accepts=dense_llama))
MISTRAL = ModelFamily("mistral", "Mistral", ("MistralForCausalLM",), ("mistral",), mistral_config)
QWEN2 = ModelFamily("qwen2", "Qwen2, Qwen2.5", ("Qwen2ForCausalLM",), ("qwen2",), qwen2_config,
                    gguf_architectures=("qwen2",), gguf=GgufFormat(qwen2_gguf_config))

"""The model registry: every family pdserve loads, by ``ModelConfig.architecture``.

``family(name)`` is a family's entry; ``hf_family(raw, source)`` picks the family of a Hugging Face
``config.json`` (by its ``architectures``, else its ``model_type``) with an error that lists every
supported architecture; ``gguf_family(arch)`` does the same for a GGUF file's ``general.architecture``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engine.config import SUPPORTED_ARCHITECTURES
from engine.models.deepseek import DEEPSEEK_V2, DEEPSEEK_V3
from engine.models.family import ModelFamily
from engine.models.gemma3 import GEMMA3
from engine.models.gpt_oss import GPT_OSS
from engine.models.llama import LLAMA, MISTRAL, QWEN2
from engine.models.mixtral import MIXTRAL
from engine.models.qwen3 import QWEN3, QWEN3_MOE

FAMILIES: dict[str, ModelFamily] = {f.name: f for f in (LLAMA, MISTRAL, QWEN2, QWEN3, QWEN3_MOE, MIXTRAL,
                                                          GEMMA3, GPT_OSS, DEEPSEEK_V2, DEEPSEEK_V3)}
assert tuple(FAMILIES) == SUPPORTED_ARCHITECTURES, "engine/config.py lists the families in this order"


def family(name: str) -> ModelFamily:
    try:
        return FAMILIES[name]
    except KeyError:
        raise ValueError(f"unsupported architecture {name!r}; supported: {', '.join(FAMILIES)}") from None


def hf_architectures() -> list[str]:
    """Every Hugging Face architecture name pdserve loads."""
    return [arch for f in FAMILIES.values() for arch in f.hf_architectures]


def hf_family(raw: dict[str, Any], source: Path) -> ModelFamily:
    archs = raw.get("architectures") or []
    for f in FAMILIES.values():
        if any(a in f.hf_architectures for a in archs):
            return f
    model_type = raw.get("model_type")
    if not archs:
        for f in FAMILIES.values():
            if model_type in f.model_types:
                return f
    found = ", ".join(archs) if archs else f"model_type={model_type!r}"
    raise ValueError(f"unsupported architecture {found} in {source}; "
                     f"supported: {', '.join(hf_architectures())}")


def gguf_family(arch: object, source: Path) -> ModelFamily:
    for f in FAMILIES.values():
        if arch in f.gguf_architectures:
            return f
    supported = [a for f in FAMILIES.values() for a in f.gguf_architectures]
    raise ValueError(f"unsupported GGUF architecture {arch!r} in {source}; supported: {', '.join(supported)}")

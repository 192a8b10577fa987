"""The model registry: every family pdserve loads, by ``ModelConfig.architecture``.

``family(name)`` is a family's entry; ``hf_family(raw, source)`` picks the family of a Hugging Face
``config.json`` (by its ``architectures``, else its ``model_type``) with an error that lists every
supported architecture; ``gguf_family(arch, source, reader)`` does the same for a GGUF file's
``general.architecture`` (llama.cpp writes Llama and Mixtral both as ``llama``: the file picks).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engine.config import SUPPORTED_ARCHITECTURES
from engine.gguf_file import GGUFFile
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


def gguf_architectures() -> list[str]:
    """Every GGUF architecture (``general.architecture``) pdserve loads."""
    listed = [arch for f in FAMILIES.values() if f.gguf is not None for arch in f.gguf_architectures]
    return list(dict.fromkeys(listed))


def gguf_family(arch: object, source: Path, reader: GGUFFile | None = None) -> ModelFamily:
    """The family that reads a GGUF of architecture ``arch``: of those listing it, the first whose format
    accepts the file (``reader``; without one, the first listing it)."""
    for f in FAMILIES.values():
        if arch in f.gguf_architectures and f.gguf is not None and (reader is None or f.gguf.accepts(reader)):
            return f
    raise ValueError(f"unsupported GGUF architecture {arch!r} in {source}; "
                     f"supported: {', '.join(gguf_architectures())}")

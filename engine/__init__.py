"""The single-node engine both roles share.

Exports resolve lazily so that light modules (``engine.hashing``, used by the
router) can be imported without pulling torch and the model code in.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.config import EngineConfig, ModelConfig
    from engine.llm import LLM
    from engine.outputs import RequestMetrics, RequestOutput
    from engine.sampling import SamplingParams

_EXPORTS = {
    "LLM": "engine.llm",
    "EngineConfig": "engine.config",
    "ModelConfig": "engine.config",
    "RequestMetrics": "engine.outputs",
    "RequestOutput": "engine.outputs",
    "SamplingParams": "engine.sampling",
}

__all__ = ["LLM", "EngineConfig", "ModelConfig", "RequestMetrics", "RequestOutput", "SamplingParams"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)

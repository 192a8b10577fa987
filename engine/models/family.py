"""``ModelFamily``: what one family's module registers.

A family names the Hugging Face architectures (``config.json``'s ``architectures``, or its
``model_type`` when that lists none) and GGUF architectures it loads, reads their config into a
``ModelConfig`` (``config_from_hf``), maps its checkpoint's tensor names onto the layer library's
(``canonical``: a family whose checkpoints store experts fused, or under other names, renames or
splits them here; the library's names are Llama's, ``engine/layers/``), and says how its model differs
at the ends (``norm_offset``: RMSNorm scales by ``1 + w``; ``sandwich_norms``: each branch normed again
before its residual add; ``embed_scale``: embeddings times ``sqrt(hidden_size)``). Everything a
layer computes is in the ``ModelConfig`` it reads. A family that reads GGUF files (of its
``gguf_architectures``, as llama.cpp writes them) says how in ``gguf`` (``engine/models/gguf_config.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.config import ModelConfig
from engine.models.gguf_config import GgufFormat

Weights = Iterable[tuple[str, torch.Tensor]]


def as_is(weights: Weights, config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """A checkpoint already named as the layer library names its tensors."""
    yield from weights


@dataclass(frozen=True)
class ModelFamily:
    name: str  # ``ModelConfig.architecture``
    title: str  # the models it covers, for users (``pdserve``'s errors and docs)
    hf_architectures: tuple[str, ...]
    model_types: tuple[str, ...]
    config_from_hf: Callable[[dict[str, Any], Path], ModelConfig]
    canonical: Callable[[Weights, ModelConfig], Iterator[tuple[str, torch.Tensor]]] = as_is
    # ``canonical`` passes on (or splits) the loader's ``BlockMatrix`` and ``BlockStack`` weights, so the
    # model may keep them (``CausalLM.takes_blocks``); as_is does
    canonical_keeps_blocks: bool = False
    gguf_architectures: tuple[str, ...] = ()
    norm_offset: bool = False
    sandwich_norms: bool = False
    embed_scale: bool = False
    gguf: GgufFormat | None = None

    @property
    def passes_blocks(self) -> bool:
        """Whether the loader's kept blocks and codes reach the model through ``canonical``."""
        return self.canonical is as_is or self.canonical_keeps_blocks

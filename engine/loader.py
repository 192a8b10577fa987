"""One entry point for model sources: a local HF folder or a ``.gguf`` file.

``load_model_source`` reads and checks the config now; weights are read only when
``iter_weights`` is iterated, and the tokenizer only when ``load_tokenizer`` is
called (the router needs the tokenizer but no weights). Under ``cache_root()``
(``$PDSERVE_CACHE``): the GGUF tokenizers converted for transformers and the
GGUF weights dequantized (``engine/gguf_cache.py``).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from engine.checkpoint_quant import CheckpointQuant
from engine.config import ModelConfig
from engine.gguf_cache import cached_gguf_weights
from engine.gguf_loader import iter_blocks, open_gguf, read_gguf_config
from engine.hf_loader import (
    iter_hf_blocks,
    iter_hf_weights,
    read_checkpoint_quant,
    read_hf_config,
    safetensors_files,
)
from engine.tensor_parallel import TpShard
from engine.tokenizer import Tokenizer
from kernels.gguf_blocks import BlockMatrix, BlockStack

DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SETUP_SCRIPT = "scripts/setup.sh"


def cache_root() -> Path:
    """``$PDSERVE_CACHE``, or ``~/.cache/pdserve``."""
    return Path(os.environ.get("PDSERVE_CACHE") or Path.home() / ".cache" / "pdserve")


def weights_cache_dir() -> Path:
    """Where dequantized GGUF weights are kept (``engine/gguf_cache.py``)."""
    return cache_root() / "weights"


def default_model_path() -> Path:
    return cache_root() / "models" / DEFAULT_MODEL_FILE


def resolve_model(model: str | None) -> Path:
    """The model path to load: ``model`` itself, or the default GGUF when ``None``."""
    if model is not None:
        return Path(model).expanduser()
    path = default_model_path()
    if not path.is_file():
        raise FileNotFoundError(
            f"the default model {path} is missing; run {SETUP_SCRIPT} to fetch it "
            "(or pass --model with a local Hugging Face folder or .gguf file)"
        )
    return path


def _tokenizer_cache_dir(path: Path) -> Path:
    stat = path.stat()
    return cache_root() / "tokenizers" / f"{path.stem}-{stat.st_size}-{stat.st_mtime_ns}"


@dataclass(frozen=True)
class ModelSource:
    """Where a model's config, weights and tokenizer come from."""

    config: ModelConfig
    path: Path
    kind: Literal["hf", "gguf"]
    quant: CheckpointQuant | None = None  # a quantized HF checkpoint's quantization_config

    def iter_weights(self, shard: TpShard | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """``(hf_name, tensor)`` pairs, read lazily: float32 for GGUF, stored dtype for HF; with a
        tensor-parallel ``shard``, only that rank's slice of each tensor is read. A GGUF's dequantized
        weights are cached under ``weights_cache_dir()`` (``engine/gguf_cache.py``)."""
        if self.kind == "gguf":
            return cached_gguf_weights(open_gguf(self.path), self.config, shard, weights_cache_dir())
        return iter_hf_weights(self.path, shard)

    def iter_blocks(self) -> Iterator[tuple[str, torch.Tensor | BlockMatrix | BlockStack]]:
        """``iter_weights`` of the whole model, but a GGUF keeps its Q4, Q5, Q6_K and Q8_0 matrices (experts'
        too) in their blocks (``BlockMatrix``; not dequantized, not cached:
        ``engine.gguf_loader.iter_blocks``),
        an fp8 checkpoint its matrices' codes and an MXFP4 one its experts as Q5_0 rows
        (``engine.hf_loader.iter_hf_blocks``). A tensor-parallel rank cuts its part of each
        (``CausalLM.load_weights``)."""
        if self.kind == "gguf":
            return iter_blocks(open_gguf(self.path), self.config)
        return iter_hf_blocks(self.path)

    def load_tokenizer(self) -> Tokenizer:
        eos = self.config.eos_token_ids
        if self.kind == "gguf":
            return Tokenizer.from_gguf(self.path, eos, cache_dir=_tokenizer_cache_dir(self.path))
        return Tokenizer.from_folder(self.path, eos)


def load_model_source(path: str | Path) -> ModelSource:
    """Read the config at ``path`` (a HF folder or a ``.gguf`` file) and check it."""
    path = Path(path).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"model path not found: {path} (expected a Hugging Face folder or a .gguf file)"
        )
    if path.is_dir():
        config = read_hf_config(path)
        safetensors_files(path)
        return ModelSource(config=config, path=path, kind="hf", quant=read_checkpoint_quant(path))
    if path.suffix.lower() == ".gguf":
        return ModelSource(config=read_gguf_config(path), path=path, kind="gguf")
    raise ValueError(
        f"unknown model file type: {path} (expected a Hugging Face folder or a .gguf file)"
    )

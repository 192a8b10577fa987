"""Read a local Hugging Face model folder: ``config.json`` (through its family's reader,
``engine/models/``) and ``*.safetensors``.

Only local files are read; nothing here talks to a model hub. Weights come out
lazily, one ``(hf_name, tensor)`` pair at a time, in the dtype they are stored in
(callers cast), or, from a quantized checkpoint, dequantized to float32
(``engine/checkpoint_quant.py``), or kept as their fp8 codes for the native product
(``iter_hf_blocks``). Tied embeddings are not repeated: a checkpoint without
``lm_head.weight`` yields none. Given a tensor-parallel ``TpShard``, each tensor is read
as the rank's slice only (``safe_open(...).get_slice``), not whole.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import cast

import torch
from safetensors import safe_open

from engine.checkpoint_quant import CheckpointQuant, checkpoint_quant, dequantized
from engine.config import ModelConfig
from engine.models.hf_config import read_json
from engine.models.registry import hf_family
from engine.tensor_parallel import TpShard
from kernels.gguf_blocks import BlockMatrix, BlockStack


def _check_folder(folder: Path) -> None:
    if not folder.exists():
        raise FileNotFoundError(f"model folder not found: {folder}")
    if not folder.is_dir():
        raise NotADirectoryError(f"not a model folder: {folder}")
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"no config.json in model folder {folder}")


def read_hf_config(folder: str | Path) -> ModelConfig:
    """Build a ``ModelConfig`` from ``folder/config.json`` (and generation_config.json)."""
    folder = Path(folder)
    _check_folder(folder)
    return read_hf_config_file(folder / "config.json")


def read_hf_config_file(source: str | Path) -> ModelConfig:
    """Build a ``ModelConfig`` from one ``config.json`` file (a generation_config.json beside it counts):
    the family its ``architectures`` name reads it (``engine/models/registry.py``)."""
    source = Path(source)
    if not source.is_file():
        raise FileNotFoundError(f"config file not found: {source}")
    raw = read_json(source)
    return hf_family(raw, source).config_from_hf(raw, source)


def safetensors_files(folder: str | Path) -> list[Path]:
    """The folder's weight files: those named by the index if there is one, else all."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"no weight_map in {index}")
        files = [folder / name for name in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{index} names missing files: {', '.join(missing)}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in model folder {folder}")
    return files


def read_checkpoint_quant(folder: str | Path) -> CheckpointQuant | None:
    """The folder's ``quantization_config`` (``engine/checkpoint_quant.py``); None: not quantized."""
    folder = Path(folder)
    return checkpoint_quant(read_json(folder / "config.json"), folder / "config.json")


def iter_hf_weights(folder: str | Path, shard: TpShard | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, tensor)`` for every tensor in the folder's safetensors files (``shard``'s slice
    of each when given); a quantized checkpoint's weights dequantized to float32, their scales consumed.

    The file list is checked now; tensors are read only as the iterator advances.
    """
    files = safetensors_files(folder)
    shard = shard if shard is not None and shard.size > 1 else None
    quant = read_checkpoint_quant(folder)
    if quant is not None:
        return cast(Iterator[tuple[str, torch.Tensor]], dequantized(files, quant, shard))
    return iter_safetensors_files(files, shard)


def iter_hf_blocks(folder: str | Path) -> Iterator[tuple[str, torch.Tensor | BlockMatrix | BlockStack]]:
    """``iter_hf_weights`` of the whole model, but an fp8 checkpoint's matrices as their codes where
    ``engine.checkpoint_quant.fp8_blocks`` keeps them (``kernels.gguf_blocks.BlockMatrix``) and MXFP4
    experts as Q5_0 rows (``mxfp4_stack``)."""
    quant = read_checkpoint_quant(folder)
    if quant is None:
        return iter_hf_weights(folder)
    return dequantized(safetensors_files(folder), quant, None, keep=True)


def iter_safetensors_files(files: list[Path], shard: TpShard | None) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of ``files`` in order, read lazily through a memory map (``shard``'s slice of each when
    given)."""
    for path in files:
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                if handle.get_slice(name).get_dtype().startswith("F8"):
                    raise ValueError(f"{path}: {name} is fp8 but config.json has no quantization_config "
                                     f"(its scales are unknown)")
                cut = shard.weight_slice(name) if shard is not None else None
                if cut is None:
                    yield name, handle.get_tensor(name)
                else:
                    index = (slice(None),) * cut.dim + (slice(cut.start, cut.stop),)
                    yield name, handle.get_slice(name)[index]

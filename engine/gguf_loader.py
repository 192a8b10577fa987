"""Read a GGUF file: ``ModelConfig`` from its metadata, float32 weights under the layer library's names.

The file is parsed by ``engine.gguf_file.GGUFFile`` (one fast pass over a memory map). Its
``general.architecture`` picks the family that reads it (``engine/models/registry.py:gguf_family``),
whose ``GgufFormat`` (``engine/models/gguf_config.py``) reads the config, names each tensor and undoes
what llama.cpp's converter changed (Q/K rows permuted for ``llama``-arch models, Gemma's norms stored
as ``1 + w``). This module is the generic part: tensors are dequantized with ``gguf.quants.dequantize``
(every type it implements, MXFP4 included; any other is an error naming the tensor and its type) and
reshaped to the Hugging Face layout (GGUF lists dimensions innermost first); llama.cpp's 3-D expert
tensors come out as one tensor per expert. ``iter_blocks`` keeps the Q4_0, Q4_1, Q5_0, Q5_1, Q8_0,
Q4_K, Q5_K and Q6_K matrices (each expert's of a 3-D stack too) in their blocks instead
(``kernels/gguf_blocks.py``), for a model that computes on them. Given a tensor-parallel ``TpShard``, a
tensor (or expert) split by rows is cut before it is dequantized (GGUF rows are whole quantization
blocks), one split by columns after.
"""

from __future__ import annotations

import functools
import importlib.metadata
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import cast

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from engine.config import ModelConfig
from engine.gguf_file import GGUFFile
from engine.models.gguf_config import GgufFormat, one_to_one, unpermute_qk
from engine.models.registry import family, gguf_family
from engine.tensor_parallel import TpShard, WeightSlice
from kernels.gguf_blocks import GGUF_KINDS, BlockKind, BlockMatrix

__all__ = ["gguf_config", "gguf_format", "iter_blocks", "iter_gguf_weights", "iter_tensors", "open_gguf",
           "read_gguf_config",
           "unpermute_qk"]


def open_gguf(path: str | Path) -> GGUFFile:
    """Open ``path``, with clear errors for a missing or bad file.

    The parsed file is shared within the process (read-only: nothing may change its ``fields``) for as
    long as the file keeps its identity, size and modification time: a worker reads the config and then
    the weights from one parse (each parse cost 0.13-0.15 s of CPU before its string arrays were left
    undecoded, ``engine.gguf_file.StringArray``)."""
    path = Path(path)
    try:
        st = path.stat()
    except OSError:
        st = None
    if st is None or not stat.S_ISREG(st.st_mode):
        raise FileNotFoundError(f"GGUF file not found: {path}")
    return _open_gguf(str(path.resolve()), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=2)
def _open_gguf(path: str, dev: int, ino: int, size: int, mtime_ns: int) -> GGUFFile:
    try:
        return GGUFFile(path)
    except ValueError as exc:
        raise ValueError(f"cannot read GGUF file {path}: {exc}") from None


def gguf_format(reader: GGUFFile, path: str | Path) -> GgufFormat:
    """How the family that reads this file (its ``general.architecture``) reads it."""
    found = gguf_family(reader.fields.get("general.architecture"), Path(path), reader)
    assert found.gguf is not None  # gguf_family picks only families with a format
    return found.gguf


def gguf_config(reader: GGUFFile, path: str | Path) -> ModelConfig:
    """Build a ``ModelConfig`` from an open reader's metadata and tensor list (every tensor checked to
    have a place in the model)."""
    path = Path(path)
    fmt = gguf_format(reader, path)
    fmt.check_tensors(reader, path)
    return fmt.config(reader, path)


def read_gguf_config(path: str | Path) -> ModelConfig:
    """Open ``path`` and read its ``ModelConfig``."""
    return gguf_config(open_gguf(path), path)


def _to_torch(gguf_name: str, data: np.ndarray, kind: GGMLQuantizationType, hf_shape: list[int],
              cut: WeightSlice | None) -> torch.Tensor:
    """``data`` (one tensor, or one expert's slice of a 3-D one) dequantized to float32 in HF layout."""
    before = cut is not None and cut.dim == 0 and len(hf_shape) > 1
    if before and cut is not None:  # rows are whole quantization blocks: cut before dequantizing
        data = data[cut.start:cut.stop]
        hf_shape = [cut.stop - cut.start, *hf_shape[1:]]
    try:
        values = dequantize(data, kind)
    except NotImplementedError:
        raise ValueError(f"tensor {gguf_name!r} is {kind.name}, which gguf {_gguf_version()} cannot "
                         f"dequantize") from None
    values = np.require(values, dtype=np.float32, requirements=["C", "W"])
    weight = torch.from_numpy(values).reshape(hf_shape)
    return cut.take(weight) if cut is not None and not before else weight


def _gguf_version() -> str:
    return importlib.metadata.version("gguf")


def iter_gguf_weights(path: str | Path, config: ModelConfig | None = None,
                      shard: TpShard | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(library_name, float32 tensor)`` for each model tensor (``shard``'s slice of it when given),
    as the family's ``GgufFormat`` names and fixes it.

    The file is opened now; tensors are dequantized only as the iterator advances.
    """
    reader = open_gguf(path)
    return iter_tensors(reader, config or gguf_config(reader, path), shard)


def iter_tensors(reader: GGUFFile, config: ModelConfig,
                 shard: TpShard | None) -> Iterator[tuple[str, torch.Tensor]]:
    """``iter_gguf_weights`` over an open file."""
    fmt = _format(config)
    return fmt.merge(cast(Iterator[tuple[str, torch.Tensor]], _fixed(reader, config, shard, fmt)), config)


def iter_blocks(reader: GGUFFile, config: ModelConfig) -> Iterator[tuple[str, torch.Tensor | BlockMatrix]]:
    """The whole model's tensors as ``iter_tensors`` yields them, but each 2-D tensor of a kind
    ``kernels.gguf_blocks.BlockKind`` names as a ``BlockMatrix`` of its rows as stored (row fixes, such as
    llama's Q/K order, applied to the rows), not dequantized. A family that merges tensors
    (``GgufFormat.merge``) gets floats only."""
    fmt = _format(config)
    if fmt.merge is not one_to_one:
        return iter(iter_tensors(reader, config, None))
    return _fixed(reader, config, None, fmt, keep=True)


def _format(config: ModelConfig) -> GgufFormat:
    fmt = family(config.architecture).gguf
    if fmt is None:
        raise ValueError(f"the {config.architecture} family reads no GGUF files")
    return fmt


def _blocks(tensor_type: GGMLQuantizationType) -> BlockKind | None:
    """The kind a matrix of this type is kept as, or None (dequantized)."""
    kind = BlockKind.__members__.get(tensor_type.name)
    return kind if kind in GGUF_KINDS else None


def _fixed(reader: GGUFFile, config: ModelConfig, shard: TpShard | None, fmt: GgufFormat,
           keep: bool = False) -> Iterator[tuple[str, torch.Tensor | BlockMatrix]]:
    for tensor in reader.tensors:
        target = fmt.target(tensor.name)
        if target is None:
            continue
        hf_shape = [int(d) for d in reversed(tensor.shape)]
        stack = "{expert}" in target
        matrix = len(hf_shape) == (3 if stack else 2)
        kind = _blocks(tensor.tensor_type) if keep and matrix else None
        if kind is not None:
            parts = ([(target.replace("{expert}", str(e)), tensor.data[e]) for e in range(hf_shape[0])]
                     if stack else [(target, tensor.data)])
            for name, data in parts:
                rows = torch.from_numpy(np.array(data, dtype=np.uint8, copy=True))
                yield name, BlockMatrix(kind, fmt.fix(name, rows, config).contiguous(), hf_shape[-1])
            continue
        pieces = [(target, tensor.data, hf_shape)]
        if "{expert}" in target:  # [experts, out, in]: one tensor per expert
            pieces = [(target.replace("{expert}", str(e)), tensor.data[e], hf_shape[1:])
                      for e in range(hf_shape[0])]
        for name, data, shape in pieces:
            cut = shard.weight_slice(name) if shard is not None and shard.size > 1 else None
            yield name, fmt.fix(name, _to_torch(tensor.name, data, tensor.tensor_type, shape, cut), config)

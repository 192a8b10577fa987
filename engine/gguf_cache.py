"""Dequantized GGUF weights kept on disk, so the next load maps them instead of dequantizing.

Dequantizing a GGUF (``gguf.quants.dequantize``, numpy) is the largest part of building an engine:
every worker, every restart and every tensor-parallel rank paid it again for the same file. The
first whole (unsharded) load writes what ``engine.gguf_loader.iter_tensors`` yields -- float32
tensors under the layer library's names, as the family fixed them -- to one safetensors file in the cache
folder (``$PDSERVE_CACHE/weights/``); later loads, whole or one tensor-parallel rank's shard, read
that file through a memory map (a shard only its slices). They are the same bytes: outputs are
identical with or without the cache.

The key (``entry_name``) hashes the cache format, the ``gguf`` library's version (it dequantizes),
the source of the modules that read the file (``gguf_file``, ``gguf_loader``, this one,
``engine/models/gguf_config.py`` and the module of the family that reads it), the stored dtype, the
file's size and modification time and its whole header (metadata and tensor table): a changed file,
another dequantizer, a changed loader or another stored dtype misses, never a stale hit.
Entries are written under a temporary name and renamed, so a reader never sees half a file; one
that cannot be read is dequantized again and rewritten. A cache that cannot be written (read-only,
full disk) costs only the dequantization. Models whose float32 weights exceed ``MAX_ENTRY_BYTES``
are not cached (a 7B GGUF would take 28 GB), and the folder keeps the most recently used entries
within ``MAX_FOLDER_BYTES``.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import logging
import math
import os
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from engine import gguf_file, gguf_loader
from engine.config import ModelConfig
from engine.gguf_file import GGUFFile
from engine.gguf_loader import gguf_format, iter_tensors
from engine.hf_loader import iter_safetensors_files
from engine.models import gguf_config
from engine.tensor_parallel import TpShard

log = logging.getLogger(__name__)

CACHE_FORMAT = 1
STORED_DTYPE = "float32"
MAX_ENTRY_BYTES = 4 << 30
MAX_FOLDER_BYTES = 8 << 30

Weights = Iterator[tuple[str, torch.Tensor]]


def entry_name(reader: GGUFFile) -> str:
    """The cache file's name for an open GGUF file (see the module docstring)."""
    stat = reader.path.stat()
    digest = hashlib.sha256()
    digest.update(f"{CACHE_FORMAT}:{importlib.metadata.version('gguf')}:{STORED_DTYPE}:"
                  f"{stat.st_size}:{stat.st_mtime_ns}:".encode())
    digest.update(reader.header)
    fmt = gguf_format(reader, reader.path)
    family_modules = sorted({fn.__module__ for fn in (fmt.config, fmt.fix, fmt.accepts)})
    readers = [gguf_file, gguf_loader, gguf_config, *(sys.modules[m] for m in family_modules)]
    for module in dict.fromkeys([*readers, sys.modules[__name__]]):  # our reading of the file, this code
        digest.update(Path(str(module.__file__)).read_bytes())
    return f"{reader.path.stem}-{digest.hexdigest()[:32]}.{STORED_DTYPE}.safetensors"


def float32_bytes(reader: GGUFFile) -> int:
    return sum(4 * math.prod(t.shape) for t in reader.tensors)


def cached_gguf_weights(reader: GGUFFile, config: ModelConfig, shard: TpShard | None,
                        folder: Path) -> Weights:
    """``(hf_name, float32 tensor)`` as ``iter_tensors`` yields them, from the cache entry in ``folder``
    when there is one; a whole load without one dequantizes and writes it."""
    if float32_bytes(reader) > MAX_ENTRY_BYTES:
        return iter_tensors(reader, config, shard)
    path = folder / entry_name(reader)
    sharded = shard is not None and shard.size > 1
    cached = _read(path, shard if sharded else None)
    if cached is not None:
        return cached
    weights = iter_tensors(reader, config, shard)
    return weights if sharded else _write_through(path, weights)


def _read(path: Path, shard: TpShard | None) -> Weights | None:
    """The entry's tensors, or None when there is no readable entry at ``path``."""
    if not path.is_file():
        return None
    try:
        weights = iter_safetensors_files([path], shard)
        first = next(weights)
    except (OSError, SafetensorError, StopIteration) as exc:
        log.warning("weight cache %s unreadable (%s): dequantizing again", path, exc or "empty")
        return None
    with contextlib.suppress(OSError):  # most recently used: the last evicted (a read-only cache still reads)
        os.utime(path)
    return _chain(first, weights)


def _chain(first: tuple[str, torch.Tensor], rest: Weights) -> Weights:
    yield first
    yield from rest


def _write_through(path: Path, weights: Weights) -> Weights:
    """Yield ``weights`` unchanged; once the last is out, store them all at ``path``."""
    kept: dict[str, torch.Tensor] = {}
    for name, tensor in weights:
        kept[name] = tensor
        yield name, tensor
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")  # one per writer
        try:
            save_file(kept, str(tmp))
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        evict(path.parent, keep=path)
    except OSError as exc:
        log.warning("weight cache %s not written: %s", path, exc)


def evict(folder: Path, keep: Path, budget: int = MAX_FOLDER_BYTES) -> None:
    """Remove the least recently used entries (never ``keep``) until they fit in ``budget`` bytes."""
    entries = []
    for entry in folder.glob(f"*.{STORED_DTYPE}.safetensors"):
        try:
            stat = entry.stat()
        except FileNotFoundError:  # another process evicted it
            continue
        entries.append((stat.st_mtime_ns, stat.st_size, entry))
    total = sum(size for _, size, _ in entries)
    for _, size, entry in sorted(entries):
        if total <= budget:
            break
        if entry != keep:
            entry.unlink(missing_ok=True)
            total -= size

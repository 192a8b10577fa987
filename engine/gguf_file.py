"""A GGUF file's metadata and tensor table, parsed in one pass over a memory map.

``gguf``'s own ``GGUFReader`` builds a numpy view for every element of every
metadata array; a Llama-family vocabulary (49k tokens and 48k merges) makes
that several seconds per open, paid by every worker and router process at
start and again at every restart. This reader walks the same format (GGUF v2
and v3, little-endian) with ``struct`` and keeps only Python values for the
metadata, with arrays of strings decoded on first use (``StringArray``), so an
open costs tens of milliseconds. Tensor data stays in the
memory map, shaped exactly as ``GGUFReader`` shapes it (quantized types as
rows of raw bytes), so ``gguf.quants.dequantize`` reads it unchanged.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, overload

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import quant_shape_to_byte_shape

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# GGUF metadata value types -> struct format (scalars) ; 8 = string, 9 = array
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q",
            12: "<d"}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
          7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9
# tensor types stored as plain numpy elements; every other type is rows of raw bytes
_PLAIN = {GGMLQuantizationType.F16: np.float16, GGMLQuantizationType.F32: np.float32,
          GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
          GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
          GGMLQuantizationType.I64: np.int64}


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor: ``shape`` lists dimensions innermost first (GGUF's order); ``data`` is a read-only
    view into the file, shaped outermost first (raw bytes per row for quantized types)."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray


class StringArray(Sequence[str]):
    """A metadata array of strings (a vocabulary's tokens and merges: 100k strings for a Llama-family
    model), decoded on first use: decoding them all costs about 0.4 s of every open, and nothing but a
    tokenizer conversion (transformers reads the file itself for that) looks at them. Equal to a list
    or tuple of the same strings; a slice is a list."""

    def __init__(self, buf: memoryview, start: int, count: int) -> None:
        self._buf, self._start, self._count = buf, start, count
        self._items: list[str] | None = None

    def _decoded(self) -> list[str]:
        if self._items is None:
            cur = _Cursor(self._buf)
            cur.pos = self._start
            self._items = [cur.string() for _ in range(self._count)]
        return self._items

    def __len__(self) -> int:
        return self._count

    @overload
    def __getitem__(self, index: int) -> str: ...

    @overload
    def __getitem__(self, index: slice) -> list[str]: ...

    def __getitem__(self, index: int | slice) -> str | list[str]:
        return self._decoded()[index]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (list, tuple, StringArray)):
            return self._decoded() == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # mutable-looking like the list it stands for

    def __repr__(self) -> str:
        return f"StringArray({self._count} strings)"


class _Cursor:
    def __init__(self, buf: memoryview) -> None:
        self.buf = buf
        self.pos = 0

    def scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        length = self.scalar("<Q")
        end = self.pos + length
        if end > len(self.buf):
            raise ValueError(f"string of {length} bytes runs past the end of the file")
        text = bytes(self.buf[self.pos:end]).decode("utf-8", errors="replace")
        self.pos = end
        return text

    def strings(self, count: int) -> StringArray:
        """An array of ``count`` strings, stepped over now (lengths only) and decoded on first use."""
        start = pos = self.pos
        for _ in range(count):
            (length,) = struct.unpack_from("<Q", self.buf, pos)
            pos += 8 + length
            if pos > len(self.buf):
                raise ValueError(f"string of {length} bytes runs past the end of the file")
        self.pos = pos
        return StringArray(self.buf, start, count)

    def value(self, kind: int) -> Any:
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item_kind, count = self.scalar("<I"), self.scalar("<Q")
            if item_kind in _NUMPY:
                dtype = np.dtype(_NUMPY[item_kind]).newbyteorder("<")
                items = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos)
                self.pos += items.nbytes
                return items.tolist()
            if item_kind == _STRING:
                return self.strings(count)
            return [self.value(item_kind) for _ in range(count)]
        if kind not in _SCALARS:
            raise ValueError(f"unknown GGUF metadata value type {kind}")
        return self.scalar(_SCALARS[kind])


class GGUFFile:
    """``fields``: metadata key -> Python value (arrays as lists); ``tensors`` in file order; tensor data
    starts at byte ``data_start``."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        cur = _Cursor(memoryview(self._map.data))
        if bytes(cur.buf[:4]) != MAGIC:
            raise ValueError("not a GGUF file (bad magic)")
        cur.pos = 4
        self.version = cur.scalar("<I")
        if self.version not in (2, 3):
            raise ValueError(f"unsupported GGUF version {self.version}")
        num_tensors, num_fields = cur.scalar("<Q"), cur.scalar("<Q")
        try:
            self.fields: dict[str, Any] = {}
            for _ in range(num_fields):
                key = cur.string()
                self.fields[key] = cur.value(cur.scalar("<I"))
            infos = [self._tensor_info(cur) for _ in range(num_tensors)]
        except struct.error as exc:
            raise ValueError(f"truncated GGUF header: {exc}") from None
        alignment = int(self.fields.get("general.alignment", DEFAULT_ALIGNMENT))
        start = -(-cur.pos // alignment) * alignment
        self.data_start = start
        self.tensors = [self._tensor(start, *info) for info in infos]
        names = [t.name for t in self.tensors]
        if len(set(names)) != len(names):
            raise ValueError("duplicated tensor names")

    @property
    def header(self) -> bytes:
        """The file's bytes before the tensor data: metadata and tensor table."""
        return bytes(self._map[:self.data_start])

    @staticmethod
    def _tensor_info(cur: _Cursor) -> tuple[str, tuple[int, ...], int, int]:
        name = cur.string()
        dims = tuple(cur.scalar("<Q") for _ in range(cur.scalar("<I")))
        return name, dims, cur.scalar("<I"), cur.scalar("<Q")

    def _tensor(self, start: int, name: str, dims: tuple[int, ...], raw_type: int,
                offset: int) -> GGUFTensor:
        kind = GGMLQuantizationType(raw_type)
        outer_first = tuple(reversed(dims))
        count = int(np.prod(dims))
        if kind in _PLAIN:
            dtype = np.dtype(_PLAIN[kind])
            shape = outer_first
        else:
            block, size = GGML_QUANT_SIZES[kind]
            dtype, count = np.dtype(np.uint8), count * size // block
            shape = quant_shape_to_byte_shape(outer_first, kind)
        begin = start + offset
        end = begin + count * dtype.itemsize
        if end > len(self._map):
            raise ValueError(f"tensor {name!r} runs past the end of the file")
        data = np.frombuffer(self._map, dtype=dtype, count=count, offset=begin).reshape(shape)
        return GGUFTensor(name=name, tensor_type=kind, shape=dims, data=data)

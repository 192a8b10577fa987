"""``engine.gguf_file.GGUFFile`` reads exactly what ``gguf.GGUFReader`` reads: every metadata value
type, arrays of numbers and of strings, plain and quantized tensors, the file's alignment."""

from __future__ import annotations

import os
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf.quants import dequantize, quantize

from engine.gguf_file import GGUFFile, StringArray
from engine.gguf_loader import open_gguf


def _write(path: Path, alignment: int | None = None) -> None:
    writer = GGUFWriter(path, "llama")
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    writer.add_uint8("t.u8", 200)
    writer.add_int8("t.i8", -7)
    writer.add_uint16("t.u16", 65000)
    writer.add_int16("t.i16", -30000)
    writer.add_uint32("t.u32", 4_000_000_000)
    writer.add_int32("t.i32", -2_000_000_000)
    writer.add_float32("t.f32", 0.25)
    writer.add_bool("t.bool", True)
    writer.add_uint64("t.u64", 2**63 + 5)
    writer.add_int64("t.i64", -(2**62))
    writer.add_float64("t.f64", 1e-300)
    writer.add_string("t.str", "héllo ▁world")
    writer.add_array("t.ints", [1, -2, 3])
    writer.add_array("t.floats", [0.5, 1.5])
    writer.add_array("t.strs", ["a", "", "ü", "<|im_end|>"] * 50)
    rng = np.random.default_rng(0)
    writer.add_tensor("f32", rng.standard_normal((3, 5)).astype(np.float32))
    writer.add_tensor("f16", rng.standard_normal((4, 2)).astype(np.float16))
    q = quantize(rng.standard_normal((2, 64)).astype(np.float32), GGMLQuantizationType.Q4_1)
    writer.add_tensor("q41", q, raw_dtype=GGMLQuantizationType.Q4_1)
    q8 = quantize(rng.standard_normal((3, 32)).astype(np.float32), GGMLQuantizationType.Q8_0)
    writer.add_tensor("q80", q8, raw_dtype=GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("alignment", [None, 64])
def test_same_as_gguf_reader(tmp_path: Path, alignment: int | None) -> None:
    path = tmp_path / "m.gguf"
    _write(path, alignment)
    ours, theirs = GGUFFile(path), GGUFReader(path)
    expected = {k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    assert ours.fields == expected
    assert ours.fields["t.u64"] == 2**63 + 5 and ours.fields["t.str"] == "héllo ▁world"
    assert ours.fields["t.strs"][:4] == ["a", "", "ü", "<|im_end|>"]
    assert [t.name for t in ours.tensors] == ["f32", "f16", "q41", "q80"]
    for mine, ref in zip(ours.tensors, theirs.tensors, strict=True):
        expected_info = (ref.name, ref.tensor_type, tuple(ref.shape.tolist()))
        assert (mine.name, mine.tensor_type, mine.shape) == expected_info
        assert mine.data.dtype == ref.data.dtype and mine.data.shape == ref.data.shape
        assert np.array_equal(mine.data, ref.data)
        assert np.array_equal(dequantize(mine.data, mine.tensor_type), dequantize(ref.data, ref.tensor_type))
    assert dequantize(ours.tensors[2].data, ours.tensors[2].tensor_type).shape == (2, 64)


def test_bad_files_are_clear_errors(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    _write(path)
    raw = path.read_bytes()
    (tmp_path / "magic.gguf").write_bytes(b"GGML" + raw[4:])
    with pytest.raises(ValueError, match="bad magic"):
        GGUFFile(tmp_path / "magic.gguf")
    (tmp_path / "short.gguf").write_bytes(raw[:200])
    with pytest.raises(ValueError, match="truncated|past the end"):
        GGUFFile(tmp_path / "short.gguf")
    (tmp_path / "nodata.gguf").write_bytes(raw[:-100])
    with pytest.raises(ValueError, match="runs past the end"):
        GGUFFile(tmp_path / "nodata.gguf")
    assert GGUFFile(path).version == gguf.GGUF_VERSION


def test_open_gguf_shares_one_parse_until_the_file_changes(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    _write(path)
    first = open_gguf(path)
    assert open_gguf(str(path)) is first  # the config and the weights read one parse
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    second = open_gguf(path)
    assert second is not first and second.fields == first.fields
    path.unlink()
    _write(path, alignment=64)  # a new file under the same name
    assert open_gguf(path).fields["general.alignment"] == 64
    path.unlink()
    with pytest.raises(FileNotFoundError, match="not found"):
        open_gguf(path)


def test_string_arrays_decode_on_first_use(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    _write(path)
    strs = GGUFFile(path).fields["t.strs"]
    assert isinstance(strs, StringArray) and len(strs) == 200
    assert strs._items is None  # stepped over at open: nothing decoded yet
    assert strs[3] == "<|im_end|>" and strs[-2] == "ü" and strs[:2] == ["a", ""]
    assert strs == ["a", "", "ü", "<|im_end|>"] * 50 and strs != ["a"] and list(strs)[-1] == "<|im_end|>"

"""The on-disk cache of dequantized GGUF weights (``engine/gguf_cache.py``): a hit gives the very tensors
dequantizing gives, whole or sharded; a changed file, a changed mtime or an unreadable entry misses."""

from __future__ import annotations

import os
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from safetensors.torch import load_file, save_file

from engine.gguf_cache import STORED_DTYPE, cached_gguf_weights, entry_name, evict
from engine.gguf_loader import iter_gguf_weights, open_gguf, read_gguf_config
from engine.tensor_parallel import TpShard

HIDDEN, FFN, HEADS, KV_HEADS, VOCAB = 64, 128, 4, 2, 96
Q8 = GGMLQuantizationType.Q8_0


def write_tiny_gguf(path: Path, seed: int = 0) -> None:
    """A one-layer llama GGUF: matrices in Q8_0 (so loading dequantizes), norms in F32."""
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_context_length(128)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_eos_token_id(2)
    head_dim = HIDDEN // HEADS
    shapes = {"token_embd.weight": (VOCAB, HIDDEN), "blk.0.attn_q.weight": (HIDDEN, HIDDEN),
              "blk.0.attn_k.weight": (KV_HEADS * head_dim, HIDDEN),
              "blk.0.attn_v.weight": (KV_HEADS * head_dim, HIDDEN),
              "blk.0.attn_output.weight": (HIDDEN, HIDDEN), "blk.0.ffn_gate.weight": (FFN, HIDDEN),
              "blk.0.ffn_up.weight": (FFN, HIDDEN), "blk.0.ffn_down.weight": (HIDDEN, FFN)}
    for name, shape in shapes.items():
        quantized = gguf.quants.quantize(rng.standard_normal(shape, dtype=np.float32), Q8)
        writer.add_tensor(name, quantized, raw_shape=quantized.shape, raw_dtype=Q8)
    for name in ("blk.0.attn_norm.weight", "blk.0.ffn_norm.weight", "output_norm.weight"):
        writer.add_tensor(name, rng.standard_normal(HIDDEN, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def load(path: Path, folder: Path, shard: TpShard | None = None) -> dict[str, torch.Tensor]:
    reader = open_gguf(path)
    return dict(cached_gguf_weights(reader, read_gguf_config(path), shard, folder))


def dequantized(path: Path, shard: TpShard | None = None) -> dict[str, torch.Tensor]:
    return dict(iter_gguf_weights(path, None, shard))


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == torch.float32, name
        assert torch.equal(got[name], tensor), name


@pytest.fixture
def model(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path)
    return path


def test_a_whole_load_writes_the_entry_and_the_next_load_reads_it(model: Path, tmp_path: Path) -> None:
    folder = tmp_path / "cache"
    want = dequantized(model)
    assert_same(load(model, folder), want)  # a miss: dequantized, then written
    entry = folder / entry_name(open_gguf(model))
    assert [p.name for p in folder.iterdir()] == [entry.name]
    assert entry.name.endswith(f".{STORED_DTYPE}.safetensors")
    assert_same(load_file(entry), want)
    # the next load reads the entry, not the GGUF: an entry changed on purpose shows through
    marked = dict(want, **{"model.norm.weight": torch.full((HIDDEN,), 7.0)})
    save_file(marked, entry)
    assert_same(load(model, folder), marked)


def test_a_shard_reads_its_slices_of_the_entry(model: Path, tmp_path: Path) -> None:
    folder = tmp_path / "cache"
    config = read_gguf_config(model)
    shards = [TpShard(config, rank, 2) for rank in range(2)]
    # no entry yet: a shard dequantizes its own rows and writes nothing (only whole loads write)
    assert_same(load(model, folder, shards[1]), dequantized(model, shards[1]))
    assert not folder.exists()
    load(model, folder)
    for shard in shards:
        assert_same(load(model, folder, shard), dequantized(model, shard))


def test_a_changed_file_misses(model: Path, tmp_path: Path) -> None:
    folder = tmp_path / "cache"
    load(model, folder)
    before = entry_name(open_gguf(model))
    write_tiny_gguf(model, seed=1)  # the same header and size, other values (and a new mtime)
    after = entry_name(open_gguf(model))
    assert after != before
    assert_same(load(model, folder), dequantized(model))
    assert sorted(p.name for p in folder.iterdir()) == sorted([before, after])


def test_a_touched_file_misses(model: Path, tmp_path: Path) -> None:
    before = entry_name(open_gguf(model))
    stat = model.stat()
    os.utime(model, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))
    assert entry_name(open_gguf(model)) != before


def test_an_unreadable_entry_is_dequantized_again_and_rewritten(model: Path, tmp_path: Path) -> None:
    folder = tmp_path / "cache"
    folder.mkdir()
    entry = folder / entry_name(open_gguf(model))
    entry.write_bytes(b"not safetensors" * 10)
    want = dequantized(model)
    assert_same(load(model, folder), want)
    assert_same(load_file(entry), want)


def test_eviction_keeps_the_most_recently_used_entries(tmp_path: Path) -> None:
    names = [f"m{i}.{STORED_DTYPE}.safetensors" for i in range(4)]
    for i, name in enumerate(names):
        (tmp_path / name).write_bytes(b"x" * 100)
        os.utime(tmp_path / name, ns=(i * 10**9, i * 10**9))
    (tmp_path / "other.bin").write_bytes(b"x" * 1000)
    evict(tmp_path, keep=tmp_path / names[0], budget=250)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([names[0], names[3], "other.bin"])


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_a_read_only_cache_still_hits(model: Path, tmp_path: Path) -> None:
    folder = tmp_path / "cache"
    want = dequantized(model)
    load(model, folder)
    entry = folder / entry_name(open_gguf(model))
    marked = dict(want, **{"model.norm.weight": torch.full((HIDDEN,), 7.0)})
    save_file(marked, entry)
    entry.chmod(0o444)
    folder.chmod(0o555)
    try:
        assert_same(load(model, folder), marked)
    finally:
        folder.chmod(0o755)

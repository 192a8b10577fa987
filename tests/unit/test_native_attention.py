"""The native CPU paged-attention kernel against the torch reference and plain dense attention."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from kernels import NativeCpuAttentionBackend, TorchAttentionBackend, get_attention_backend
from kernels.attention import AttentionMetadata
from kernels.cpu_native import build_library, library_name, load_library, native_available
from tests.unit.attention_cases import make_case

pytestmark = pytest.mark.skipif(not native_available(), reason="native CPU attention cannot be built here")


def make_step(
    query_lens: list[int],
    seq_lens: list[int],
    num_heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    seed: int = 0,
) -> tuple[AttentionMetadata, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Metadata, the cache (earlier tokens written, shuffled block ids), q, new k/v and the dense answer."""
    meta, kv, q, new_k, new_v, expected, *_ = make_case(
        query_lens, seq_lens, num_heads, kv_heads, head_dim, block_size, seed)
    return meta, kv, q, new_k, new_v, expected


def run_native(
    query_lens: list[int],
    seq_lens: list[int],
    num_heads: int,
    kv_heads: int,
    head_dim: int = 64,
    block_size: int = 16,
    seed: int = 0,
    num_threads: int | None = None,
) -> None:
    meta, kv, q, k, v, expected = make_step(
        query_lens, seq_lens, num_heads, kv_heads, head_dim, block_size, seed
    )
    scale = head_dim**-0.5
    kv_ref = kv.clone()
    reference = TorchAttentionBackend()
    reference.prepare(meta)
    ref_out = reference.forward(q, k, v, kv_ref, scale)

    native = NativeCpuAttentionBackend(num_threads)
    native.prepare(meta)
    out = native.forward(q, k, v, kv, scale)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    assert torch.equal(kv, kv_ref), "K/V slot writes differ from the torch backend"


@pytest.mark.parametrize(("num_heads", "kv_heads"), [(9, 3), (6, 1), (4, 4)])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_mixed_batch(num_heads: int, kv_heads: int, head_dim: int) -> None:
    # decodes, prefill chunks starting mid-sequence, a whole prompt; partial last blocks
    run_native([1, 7, 1, 23, 1, 40], [13, 45, 4, 23, 100, 71], num_heads, kv_heads, head_dim, block_size=16)


@pytest.mark.parametrize("num_threads", [1, 2, 3])
def test_pure_decode_threads(num_threads: int) -> None:
    lens = [1, 2, 15, 16, 17, 31, 33, 64, 100, 129]
    run_native([1] * len(lens), lens, 9, 3, block_size=16, seed=1, num_threads=num_threads)


@pytest.mark.parametrize("block_size", [1, 4, 64])
def test_block_sizes(block_size: int) -> None:
    run_native([1, 9, 1], [70, 20, 3], 8, 2, head_dim=64, block_size=block_size, seed=2)


@pytest.mark.parametrize(("num_heads", "kv_heads", "head_dim", "block_size", "threads"), [
    (9, 3, 64, 16, 2),  # the default model's shape
    (8, 1, 128, 8, 3),  # 8 query heads per KV head: the most the blocked kernel takes
    (16, 1, 64, 32, 2),  # 16 per KV head: prompt chunks stay on the row kernel
    (4, 2, 80, 128, 1),  # a head size the 16-float build leaves to the row kernel; one block per tile
    (2, 2, 64, 1, 2),  # one-token blocks: every key of a tile from another block
])
def test_prompt_chunks(num_heads: int, kv_heads: int, head_dim: int, block_size: int, threads: int) -> None:
    """Chunks of 16 tokens or more take the blocked kernel (8-token items, 64-key tiles gathered across
    blocks): whole prompts, chunks after a cached prefix longer than a tile, lengths that fill neither
    an item nor a tile, beside decode rows."""
    run_native([16, 1, 37, 100, 1, 17], [16, 90, 37, 230, 5, 150], num_heads, kv_heads, head_dim,
               block_size=block_size, seed=9, num_threads=threads)


def test_many_heads_split_across_items() -> None:
    # 40 query heads do not fit one work item: rows are split within a token
    run_native([3, 1], [10, 33], 40, 8, head_dim=64, block_size=8, seed=3)


def test_q_view_with_token_stride() -> None:
    meta, kv, q, k, v, expected = make_step([1, 5], [20, 9], 6, 2, 64, 16, seed=4)
    qkv = torch.cat([q, torch.randn(q.shape[0], 4, 64)], dim=1)  # q as a strided view, as the model passes it
    native = NativeCpuAttentionBackend()
    native.prepare(meta)
    out = native.forward(qkv[:, :6], k, v, kv, 64**-0.5)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("query_lens", [[1, 6, 1], [1, 21, 40]])  # the row kernel; prompt chunks too
def test_bfloat16_cache(query_lens: list[int]) -> None:
    meta, kv, q, k, v, expected = make_step(query_lens, [30, 22, 90], 9, 3, 64, 16, seed=5)
    ref_kv = kv.to(torch.bfloat16)
    native_kv = ref_kv.clone()
    reference = TorchAttentionBackend()
    reference.prepare(meta)
    ref_out = reference.forward(q.bfloat16(), k, v, ref_kv, 0.125)
    native = NativeCpuAttentionBackend()
    native.prepare(meta)
    out = native.forward(q.bfloat16(), k, v, native_kv, 0.125)
    assert out.dtype == torch.bfloat16
    assert torch.equal(native_kv, ref_kv)
    torch.testing.assert_close(out.float(), expected, atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(out.float(), ref_out.float(), atol=2e-2, rtol=2e-2)


def test_unsupported_dtype_falls_back_to_torch() -> None:
    meta, kv, q, k, v, expected = make_step([1, 4], [9, 12], 4, 2, 64, 16, seed=6)
    native = NativeCpuAttentionBackend()
    native.prepare(meta)
    out = native.forward(q.double(), k.double(), v.double(), kv.double(), 0.125)
    torch.testing.assert_close(out, expected.double(), atol=1e-5, rtol=1e-5)


def test_backend_is_reusable_across_steps() -> None:
    backend = get_attention_backend("cpu")
    assert isinstance(backend, NativeCpuAttentionBackend)
    kv = torch.zeros(4, 2, 4, 1, 64)
    for step, (q_len, s_len) in enumerate([(3, 3), (1, 4), (1, 5)]):
        backend.prepare(AttentionMetadata.build(4, [q_len], [s_len], [[2, 0]]))
        q = torch.randn(q_len, 2, 64)
        out = backend.forward(q, torch.randn(q_len, 1, 64), torch.randn(q_len, 1, 64), kv, 0.25)
        assert out.shape == (q_len, 2, 64), step
    assert kv[0, :, 1:].abs().sum() == 0


def test_library_name_changes_with_source_and_compiler() -> None:
    base = library_name(b"int x;", "gcc 12.2.0", "cpu")
    assert base == library_name(b"int x;", "gcc 12.2.0", "cpu")
    assert base != library_name(b"int x; ", "gcc 12.2.0", "cpu")
    assert base != library_name(b"int x;", "gcc 13.1.0", "cpu")
    assert base != library_name(b"int x;", "gcc 12.2.0", "other cpu")
    assert base.endswith(".so")


def test_build_is_cached_by_name(tmp_path: Path) -> None:
    """The session's build (``load_library``) left no temporary file in its cache; a folder that holds a
    library of this build's name is not built into again (a copy of the session's, not a second compile)."""
    built = build_library()
    assert load_library() is not None and built.exists()
    assert not [p.name for p in built.parent.iterdir() if p.name.endswith(".tmp.so")]
    first = tmp_path / built.name
    shutil.copy2(built, first)
    mtime = first.stat().st_mtime_ns
    assert build_library(tmp_path) == first
    assert first.stat().st_mtime_ns == mtime
    assert [p.name for p in tmp_path.iterdir()] == [first.name]


def test_failed_build_warns_and_falls_back(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "no-such-compiler-pdserve")
    load_library.cache_clear()
    try:
        with caplog.at_level("WARNING", logger="kernels.cpu_native"):
            assert not native_available()
            assert isinstance(get_attention_backend("cpu"), TorchAttentionBackend)
        assert sum("native CPU attention unavailable" in r.getMessage() for r in caplog.records) == 1
    finally:
        load_library.cache_clear()

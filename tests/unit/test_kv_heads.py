"""Which KV heads a decode rank reads from which prefill rank (``transfer/heads.py``), and the handshake's
checks across tensor-parallel sizes (``transfer/compat.py``)."""

from __future__ import annotations

import msgspec
import pytest

from transfer.compat import check_compatible, compat_hash
from transfer.errors import IncompatibleKvError
from transfer.heads import HeadRun, head_reads
from transfer.wire import WIRE_VERSION, AgentInfo, KvLayout


def shard(size: int, rank: int, total: int) -> KvLayout:
    """``engine/tensor_parallel.py``'s split: ``total/size`` heads each, or one replicated head."""
    heads = max(total // size, 1)
    base = KvLayout("m", "float32", 2, 8, 4, heads, 8, 4)
    return base.sharded(size, rank, rank * total // size, total)


def group(size: int, total: int) -> list[KvLayout]:
    return [shard(size, r, total) for r in range(size)]


@pytest.mark.parametrize(("p", "d", "total", "want"), [
    (2, 1, 2, [[HeadRun(0, 0, 1), HeadRun(1, 1, 2)]]),
    (1, 2, 2, [[HeadRun(0, 0, 1)], [HeadRun(0, 1, 2)]]),
    (2, 2, 2, [[HeadRun(0, 0, 1)], [HeadRun(1, 1, 2)]]),
    (4, 2, 8, [[HeadRun(0, 0, 2), HeadRun(1, 2, 4)], [HeadRun(2, 4, 6), HeadRun(3, 6, 8)]]),
    (2, 4, 8, [[HeadRun(0, 0, 2)], [HeadRun(0, 2, 4)], [HeadRun(1, 4, 6)], [HeadRun(1, 6, 8)]]),
    (4, 1, 2, [[HeadRun(0, 0, 1), HeadRun(2, 1, 2)]]),  # 2 KV heads over 4 ranks: each held twice
    (2, 4, 1, [[HeadRun(0, 0, 1)], [HeadRun(1, 0, 1)], [HeadRun(0, 0, 1)], [HeadRun(1, 0, 1)]]),  # MQA
])
def test_each_decode_rank_reads_exactly_its_heads(p: int, d: int, total: int,
                                                  want: list[list[HeadRun]]) -> None:
    sources = group(p, total)
    assert [head_reads(sink, sources) for sink in group(d, total)] == want


def test_an_incomplete_source_group_is_refused() -> None:
    with pytest.raises(IncompatibleKvError, match="incomplete") as err:
        head_reads(shard(1, 0, 2), group(2, 2)[:1])
    assert err.value.field == "tp_size"


def info(layout: KvLayout) -> AgentInfo:
    return AgentInfo(WIRE_VERSION, compat_hash(layout), "peer", b"", 0, 0, "DRAM", layout)


def test_hash_covers_tp_size_and_head_range_and_different_sizes_are_compatible() -> None:
    one, halves = shard(1, 0, 2), group(2, 2)
    assert len({compat_hash(one), *map(compat_hash, halves)}) == 3
    for half in halves:
        check_compatible(one, info(half))
        check_compatible(half, info(one))
    other_model = msgspec.structs.replace(halves[0], total_kv_heads=4)
    with pytest.raises(IncompatibleKvError) as err:
        check_compatible(one, info(other_model))
    assert err.value.field == "num_kv_heads"
    forged = msgspec.structs.replace(info(halves[1]), compat_hash=compat_hash(halves[0]))
    with pytest.raises(IncompatibleKvError, match="does not match its layout"):
        check_compatible(one, forged)


def test_a_quantized_cache_moves_only_between_equal_head_ranges() -> None:
    fp8: dict[str, object] = dict(dtype="float8_e4m3fn", element_size=1)
    one = msgspec.structs.replace(shard(1, 0, 2), scale_region_bytes=16, **fp8)
    half = msgspec.structs.replace(shard(2, 0, 2), scale_region_bytes=8, **fp8)
    with pytest.raises(IncompatibleKvError, match="equal KV head ranges") as err:
        check_compatible(one, info(half))
    assert err.value.field == "scale_region_bytes"
    check_compatible(one, info(one))


def test_staging_chunks_a_read_in_order_by_what_fits() -> None:
    from transfer.staging import blocks_per_chunk, chunks

    src = shard(1, 0, 2)  # 2 layers of 2 * 4 tokens * 2 heads * 8 * 4 bytes = 512-byte regions
    assert blocks_per_chunk(src, 3 * 2 * 512) == 3
    assert blocks_per_chunk(src, 3 * 2 * 512 + 1023) == 3
    assert chunks(7, 3) == [slice(0, 3), slice(3, 6), slice(6, 7)]
    assert chunks(6, 3) == [slice(0, 3), slice(3, 6)]
    assert chunks(0, 3) == []
    with pytest.raises(ValueError, match="staging_bytes 1023 is below one block"):
        blocks_per_chunk(src, 1023)


@pytest.mark.parametrize(("p", "d", "total"),
                         [(2, 1, 2), (1, 2, 2), (4, 2, 8), (2, 4, 8), (4, 1, 2), (2, 4, 1)])
def test_a_staged_read_places_each_source_rank_heads_where_the_sink_holds_them(p: int, d: int,
                                                                              total: int) -> None:
    """``read_tables``' descriptors, followed through their addresses (as a READ would) into staging, then
    ``copy_heads``, leave every decode rank's cache equal to the model's KV of its heads; a run of
    consecutive blocks is one descriptor per layer."""
    import ctypes

    import numpy as np
    import torch

    from transfer.staging import blocks_per_chunk, chunks, copy_heads, read_tables

    sources, sinks = group(p, total), group(d, total)
    full = torch.randn(2, 8, 2, 4, total, 8)  # the model's KV: [layers, blocks, K/V, tokens, heads, dim]
    caches = [full[:, :, :, :, slice(*s.kv_head_range)].contiguous() for s in sources]
    remote = np.array([5, 6, 7, 1, 2], dtype=np.int64)
    local = np.array([0, 3, 4, 6, 2], dtype=np.int64)
    for sink in sinks:
        cache = torch.zeros(sink.shape)
        for i in {run.source for run in head_reads(sink, sources)}:
            runs = [run for run in head_reads(sink, sources) if run.source == i]
            src = sources[i]
            staging = torch.empty(3 * src.num_layers * src.region_bytes, dtype=torch.uint8)
            per = blocks_per_chunk(src, staging.numel())
            for part in chunks(len(remote), per):
                staged, source_side = read_tables(staging.data_ptr(), 0, src, caches[i].data_ptr(), 0,
                                                  remote[part])
                # [5, 6, 7] then [1, 2]: each a run of consecutive blocks, one descriptor per layer
                assert len(staged) == src.num_layers and (staged[:, 1] == source_side[:, 1]).all()
                for (to, n, _), (frm, _, _) in zip(staged, source_side, strict=True):
                    ctypes.memmove(int(to), int(frm), int(n))
                copy_heads(cache, staging, src, sink, runs, local[part])
        want = torch.zeros(sink.shape)
        want[:, local] = full[:, remote][:, :, :, :, slice(*sink.kv_head_range)]
        assert torch.equal(cache, want)

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


def test_head_rows_address_exactly_the_heads_of_each_token() -> None:
    """``KvSink``'s descriptors for a part of a rank's heads, read back through their addresses, are the
    tensor's slice of those heads in every layer, block, K/V and token (NHD layout)."""
    import ctypes

    import numpy as np
    import torch

    from transfer.nixl_sink import _rows

    layout = KvLayout("m", "float32", 3, 5, 4, 4, 8, 4).sharded(1, 0, 0, 4)
    cache = torch.randn(layout.shape)
    blocks = np.array([3, 1], dtype=np.int64)
    table = _rows(cache.data_ptr(), layout, blocks, head=1, length=2 * 8 * 4, device=0)
    assert table.shape == (3 * 2 * 2 * 4, 3)
    got = b"".join(ctypes.string_at(int(addr), int(n)) for addr, n, _ in table)
    assert got == cache[:, [3, 1], :, :, 1:3, :].contiguous().numpy().tobytes()
    # a rank holding heads [2, 4) of 4: global head 3 is its second
    shard = KvLayout("m", "float32", 3, 5, 4, 2, 8, 4).sharded(2, 1, 2, 4)
    part = torch.randn(shard.shape)
    table = _rows(part.data_ptr(), shard, blocks, head=3, length=8 * 4, device=0)
    got = b"".join(ctypes.string_at(int(addr), int(n)) for addr, n, _ in table)
    assert got == part[:, [3, 1], :, :, 1:2, :].contiguous().numpy().tobytes()

"""The descriptor arithmetic of a KV read (``transfer/descriptors.py``) and what a read plans to move
(``transfer/read_plan.py``), without NIXL: a read is carried out here by copying the bytes the two
descriptor tables name, row by row, between two numpy buffers standing for the caches."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from transfer.descriptors import check_block_range, merged_descriptor_count, region_indices, region_table
from transfer.errors import IncompatibleKvError, TransferError
from transfer.heads import HeadRun
from transfer.read_plan import plan_read
from transfer.sink_handshake import Peer, Remote
from transfer.staging_buffer import StagingBuffer
from transfer.wire import WIRE_VERSION, AgentInfo, KvHandle, KvLayout

SOURCE = KvLayout("m", "float32", num_layers=3, num_blocks=12, block_size=4, num_kv_heads=2, head_dim=4,
                  element_size=4)
SINK = KvLayout("m", "float32", num_layers=3, num_blocks=8, block_size=4, num_kv_heads=2, head_dim=4,
                element_size=4)
# a quantized cache: a float32 scale per (K/V, head) of each block, in regions after the K/V ones
FP8_SOURCE = KvLayout("m", "float8_e4m3fn", num_layers=2, num_blocks=6, block_size=4, num_kv_heads=2,
                      head_dim=4, element_size=1, scale_region_bytes=16)
FP8_SINK = KvLayout("m", "float8_e4m3fn", num_layers=2, num_blocks=5, block_size=4, num_kv_heads=2,
                    head_dim=4, element_size=1, scale_region_bytes=16)


def cache_bytes(layout: KvLayout, seed: int) -> np.ndarray:
    """A cache's bytes (K/V regions, then scale regions), filled with ``seed``'s noise."""
    count = layout.num_layers * layout.num_blocks * (layout.region_bytes + layout.scale_region_bytes)
    return np.random.default_rng(seed).integers(0, 256, count, dtype=np.uint8)


def scales_at(layout: KvLayout) -> int:
    return layout.num_layers * layout.num_blocks * layout.region_bytes


def copy_rows(dst: np.ndarray, dst_table: np.ndarray, src: np.ndarray, src_table: np.ndarray) -> None:
    """What a READ of these descriptor rows does (addresses are offsets into the buffers here)."""
    for (d, length, _), (s, src_length, _) in zip(dst_table.tolist(), src_table.tolist(), strict=True):
        assert length == src_length
        dst[d:d + length] = src[s:s + length]


def region(cache: np.ndarray, layout: KvLayout, layer: int, block: int, scales: bool = False) -> np.ndarray:
    row = layer * layout.num_blocks + block
    if scales:
        start = scales_at(layout) + row * layout.scale_region_bytes
        return cache[start:start + layout.scale_region_bytes]
    return cache[row * layout.region_bytes:(row + 1) * layout.region_bytes]


def test_region_table_lists_every_region_layer_major_then_the_scales() -> None:
    table = region_table(1000, SINK, device_id=3)
    assert table.shape == (SINK.num_layers * SINK.num_blocks, 3)
    assert table[:, 0].tolist() == [1000 + i * SINK.region_bytes for i in range(len(table))]
    assert set(table[:, 1].tolist()) == {SINK.region_bytes} and set(table[:, 2].tolist()) == {3}
    fp8 = region_table(0, FP8_SINK, 0, scales_addr=50_000)
    count = FP8_SINK.num_layers * FP8_SINK.num_blocks
    assert fp8.shape == (2 * count, 3)
    assert fp8[count:, 0].tolist() == [50_000 + i * FP8_SINK.scale_region_bytes for i in range(count)]
    assert set(fp8[count:, 1].tolist()) == {FP8_SINK.scale_region_bytes}


@pytest.mark.parametrize(("source", "sink"), [(SOURCE, SINK), (FP8_SOURCE, FP8_SINK)], ids=["fp32", "fp8"])
def test_reading_the_indexed_rows_moves_every_layer_of_each_block_where_it_belongs(
        source: KvLayout, sink: KvLayout) -> None:
    remote, local = np.array([5, 0, 4, 1]), np.array([2, 3, 0, 4])
    src, dst = cache_bytes(source, 1), cache_bytes(sink, 2)
    before = dst.copy()
    remote_idx, local_idx = region_indices(sink, source, remote, local)
    assert remote_idx.dtype == local_idx.dtype == np.int32
    src_table = region_table(0, source, 0, scales_at(source))
    dst_table = region_table(0, sink, 0, scales_at(sink))
    copy_rows(dst, dst_table[local_idx], src, src_table[remote_idx])
    quantized = bool(sink.scale_region_bytes)
    for layer in range(sink.num_layers):
        for block in range(sink.num_blocks):
            for scales in (False, True) if quantized else (False,):
                got = region(dst, sink, layer, block, scales)
                if block in local:
                    want = region(src, source, layer, int(remote[list(local).index(block)]), scales)
                else:
                    want = region(before, sink, layer, block, scales)  # untouched
                assert np.array_equal(got, want), (layer, block, scales)


def addresses_merged(local_table: np.ndarray, remote_table: np.ndarray) -> int:
    """Descriptors left when rows contiguous in address on both sides merge: what NIXL posts."""
    count = len(local_table)
    for i in range(1, len(local_table)):
        if all(t[i, 0] == t[i - 1, 0] + t[i - 1, 1] for t in (local_table, remote_table)):
            count -= 1
    return count


def test_merged_count_is_what_address_contiguity_leaves() -> None:
    rng = np.random.default_rng(0)
    src_table, dst_table = region_table(0, SOURCE, 0), region_table(0, SINK, 0)
    assert merged_descriptor_count(np.array([]), np.array([])) == 0
    cases = [(np.arange(2, 6), np.arange(0, 4)), (np.arange(SOURCE.num_blocks)[:SINK.num_blocks],
                                                    np.arange(SINK.num_blocks))]
    cases += [(rng.choice(SOURCE.num_blocks, n, replace=False), rng.choice(SINK.num_blocks, n, replace=False))
              for n in (1, 3, 5, 8) for _ in range(20)]
    for remote, local in cases:
        remote_idx, local_idx = region_indices(SINK, SOURCE, remote, local)
        got = merged_descriptor_count(local_idx, remote_idx)
        assert got == addresses_merged(dst_table[local_idx], src_table[remote_idx]), (remote, local)
    whole_layers = region_indices(SINK, SINK, np.arange(SINK.num_blocks), np.arange(SINK.num_blocks))
    assert merged_descriptor_count(*whole_layers) == 1  # every block, every layer: one run
    assert merged_descriptor_count(*region_indices(SINK, SOURCE, np.arange(2, 6), np.arange(4))) == 3


def test_block_ids_out_of_range_are_refused_naming_the_side() -> None:
    check_block_range("local", np.array([0, 7]), 8)
    check_block_range("local", np.array([], dtype=np.int64), 8)
    with pytest.raises(ValueError, match=r"remote block id out of range \[0, 8\): \[3, 8\]"):
        check_block_range("remote", np.array([3, 8]), 8)
    with pytest.raises(ValueError, match="local block id out of range"):
        check_block_range("local", np.array([-1]), 8)


def agent_info(layout: KvLayout, name: str = "prefill-0") -> AgentInfo:
    return AgentInfo(wire_version=WIRE_VERSION, compat_hash="h", agent_name=name, metadata=b"", base_addr=0,
                     device_id=0, mem_type="DRAM", layout=layout)


def handle(blocks: list[int], compat: str = "h") -> KvHandle:
    return KvHandle("r", "prefill-0", blocks, 4 * len(blocks), compat, lease_deadline=0.0)


def test_a_direct_plan_counts_bytes_and_merged_descriptors() -> None:
    info = agent_info(SOURCE)
    remote = Remote(info, [Peer(info, [HeadRun(0, 0, 2)], whole=True)])
    staging = StagingBuffer(1 << 16, torch.device("cpu"), device_id=0, backend="UCX")
    plan = plan_read(handle([2, 3, 4, 5]), remote, SINK, [2, 3, 4, 5], [0, 1, 2, 3], staging, "UCX")
    assert [(d.peer, d.remote_idx.tolist()[:4], d.local_idx.tolist()[:4]) for d in plan.direct] == [
        (remote.peers[0], [2, 3, 4, 5], [0, 1, 2, 3])]
    assert plan.staged == [] and plan.carries_notification(remote)
    stats = plan.stats
    assert (stats.blocks, stats.bytes, stats.descriptors, stats.staged_bytes) == (
        4, 4 * SINK.num_layers * SINK.region_bytes, SINK.num_layers, 0)
    empty = plan_read(handle([]), remote, SINK, [], [], staging, "UCX")
    assert empty.empty and empty.stats.bytes == 0 and empty.stats.descriptors == 0


def test_a_plan_refuses_before_anything_is_posted() -> None:
    info = agent_info(SOURCE)
    remote = Remote(info, [Peer(info, [HeadRun(0, 0, 2)], whole=True)])
    staging = StagingBuffer(1 << 16, torch.device("cpu"), device_id=0, backend="UCX")
    with pytest.raises(IncompatibleKvError) as err:
        plan_read(handle([1], compat="other"), remote, SINK, [1], [1], staging, "UCX")
    assert err.value.field == "compat_hash"
    with pytest.raises(ValueError, match="2 remote blocks but 1 local blocks"):
        plan_read(handle([1, 2]), remote, SINK, [1, 2], [1], staging, "UCX")
    with pytest.raises(ValueError, match="remote block id out of range"):
        plan_read(handle([12]), remote, SINK, [12], [1], staging, "UCX")
    with pytest.raises(ValueError, match="local block id out of range"):
        plan_read(handle([1]), remote, SINK, [1], [8], staging, "UCX")


def test_the_descriptor_arithmetic_loads_without_nixl() -> None:
    code = ("import sys, transfer.descriptors; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'nixl'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         timeout=120, cwd=Path(__file__).resolve().parents[2])
    assert out.stdout.strip() == "[]", out.stderr


def test_staged_reads_take_turns_on_the_buffer_within_their_deadlines() -> None:
    """A free buffer is taken at once, whatever the deadline; a held one is waited for at most until the
    read's deadline: its ``timeout`` ("timeout") or its lease ("expired"), whichever ends first."""
    staging = StagingBuffer(1 << 16, torch.device("cpu"), device_id=0, backend="UCX")
    later = KvHandle("late", "prefill-0", [1], 4, "h", lease_deadline=time.time() + 60)
    ended = KvHandle("ended", "prefill-0", [1], 4, "h", lease_deadline=time.time() - 1)
    order: list[str] = []

    async def main() -> list[str]:
        async with staging.turn(ended, timeout=0.0):
            order.append("free")
        held, refusals = asyncio.Event(), list[str]()

        async def hold() -> None:
            async with staging.turn(later, timeout=60):
                held.set()
                while len(refusals) < 2:  # the others queue or give up while this read stages
                    await asyncio.sleep(0)
                order.append("first")

        async def after() -> None:
            await held.wait()
            async with staging.turn(later, timeout=60):
                order.append("second")

        async def refused(handle: KvHandle, timeout: float) -> None:
            await held.wait()
            with pytest.raises(TransferError) as err:
                async with staging.turn(handle, timeout):
                    order.append("never")
            refusals.append(err.value.outcome)

        await asyncio.wait_for(asyncio.gather(hold(), after(), refused(later, 0.0), refused(ended, 60)), 30)
        assert sorted(refusals) == ["expired", "timeout"] and not staging.in_use
        return order

    assert asyncio.run(main()) == ["free", "first", "second"]

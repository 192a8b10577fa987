"""KV transfer over real NIXL (UCX) between two real processes.

The source (prefill side) runs in a spawned child holding a seeded random KV cache;
the sink (decode side) runs in the test process with a larger, differently sized
pool. The two talk over a Pipe with msgspec messages; every wait has a timeout.
"""

from __future__ import annotations

import asyncio
import hashlib
import multiprocessing as mp
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import Any

import msgspec
import pytest
import torch

from messages.codec import pack, unpack
from tests.waiting import wait_until
from transfer.errors import IncompatibleKvError, TransferError
from transfer.wire import WIRE_VERSION, AgentInfo, KvHandle, KvLayout

SRC_LAYOUT = KvLayout(
    "tiny", "float32", num_layers=3, num_blocks=10, block_size=4, num_kv_heads=2, head_dim=8, element_size=4
)
SINK_LAYOUT = msgspec.structs.replace(SRC_LAYOUT, num_blocks=16)
WAIT_S = 20.0


class Command(msgspec.Struct, frozen=True):
    op: str  # "lease" | "poll" | "hashes" | "stop"
    request_id: str = ""
    deadline: float = 0.0
    block_ids: list[int] = []
    now: float | None = None


class Reply(msgspec.Struct, frozen=True):
    released: list[str] = []
    expired: list[str] = []
    hashes: list[str] = []
    num_leases: int = 0


def block_hashes(kv: torch.Tensor, block_ids: list[int]) -> list[str]:
    return [hashlib.sha256(kv[:, b].contiguous().numpy().tobytes()).hexdigest() for b in block_ids]


def source_main(conn: Connection) -> None:
    """The prefill side: a KvSource over a seeded random cache, driven by commands."""
    from transfer.nixl_source import KvSource

    torch.manual_seed(0)
    kv = torch.randn(SRC_LAYOUT.shape)
    source = KvSource(kv, SRC_LAYOUT, "prefill-0")
    conn.send_bytes(pack(source.agent_info()))
    while conn.poll(WAIT_S * 3):
        cmd = unpack(conn.recv_bytes(), Command)
        if cmd.op == "stop":
            break
        if cmd.op == "lease":
            source.add_lease(cmd.request_id, cmd.deadline)
            reply = Reply()
        elif cmd.op == "poll":
            released, expired = source.poll(cmd.now)
            reply = Reply(released=released, expired=expired)
        else:
            reply = Reply(hashes=block_hashes(kv, cmd.block_ids))
        conn.send_bytes(pack(msgspec.structs.replace(reply, num_leases=source.num_leases())))
    source.close()


class SourcePeer:
    def __init__(self, conn: Connection, info: AgentInfo) -> None:
        self.conn = conn
        self.info = info

    def call(self, cmd: Command) -> Reply:
        self.conn.send_bytes(pack(cmd))
        if not self.conn.poll(WAIT_S):
            raise TimeoutError(f"source did not answer {cmd.op}")
        return unpack(self.conn.recv_bytes(), Reply)

    def lease(self, request_id: str, ttl: float = 30.0) -> KvHandle:
        deadline = time.time() + ttl
        self.call(Command("lease", request_id=request_id, deadline=deadline))
        return KvHandle(
            request_id, self.info.agent_name, list(range(10)), 40, self.info.compat_hash, deadline
        )

    def wait_released(self, *request_ids: str) -> None:
        """Until the source reported every one of ``request_ids`` released (one poll may report several)."""
        released: set[str] = set()

        def all_released() -> bool:
            released.update(self.call(Command("poll")).released)
            return released >= set(request_ids)

        wait_until(all_released, WAIT_S, f"the source reporting {request_ids} released", 0.01,
                   lambda: sorted(released))


@pytest.fixture(scope="module")
def source() -> Iterator[SourcePeer]:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=source_main, args=(child,), daemon=True)
    proc.start()
    try:
        if not parent.poll(60):
            raise TimeoutError("source process did not start")
        yield SourcePeer(parent, unpack(parent.recv_bytes(), AgentInfo))
        parent.send_bytes(pack(Command("stop")))
        proc.join(10)
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(5)


@pytest.fixture(scope="module")
def sink(source: SourcePeer) -> Iterator[Any]:
    from transfer.nixl_sink import KvSink

    kv = torch.full(SINK_LAYOUT.shape, -7.0)
    sink = KvSink(kv, SINK_LAYOUT, "decode-0")
    sink.connect(source.info)
    yield sink
    sink.close()


def sink_kv(sink: Any) -> torch.Tensor:
    return sink._kv_cache


def test_read_moves_exact_bytes_and_only_listed_blocks(source: SourcePeer, sink: Any) -> None:
    handle = source.lease("req-exact")
    remote, local = [3, 4, 5, 6, 7, 8, 9], [5, 6, 7, 8, 9, 10, 11]
    before = sink_kv(sink).clone()
    stats = asyncio.run(sink.read(handle, remote, local, timeout=WAIT_S))
    assert block_hashes(sink_kv(sink), local) == source.call(Command("hashes", block_ids=remote)).hashes
    untouched = [b for b in range(SINK_LAYOUT.num_blocks) if b not in local]
    assert torch.equal(sink_kv(sink)[:, untouched], before[:, untouched])
    assert stats.blocks == 7
    assert stats.bytes == 7 * SRC_LAYOUT.num_layers * SRC_LAYOUT.region_bytes
    assert stats.descriptors == SRC_LAYOUT.num_layers  # one merged run per layer
    assert stats.backend == "UCX" and stats.seconds > 0
    source.wait_released("req-exact")


def test_scattered_subset_blocking(source: SourcePeer, sink: Any) -> None:
    handle = source.lease("req-scatter")
    remote, local = [9, 0, 4], [1, 15, 2]
    before = sink_kv(sink).clone()
    stats = sink.read_blocking(handle, remote, local, timeout=WAIT_S)
    assert block_hashes(sink_kv(sink), local) == source.call(Command("hashes", block_ids=remote)).hashes
    untouched = [b for b in range(SINK_LAYOUT.num_blocks) if b not in local]
    assert torch.equal(sink_kv(sink)[:, untouched], before[:, untouched])
    assert (stats.blocks, stats.descriptors) == (3, 3 * SRC_LAYOUT.num_layers)
    source.wait_released("req-scatter")


def test_empty_read_still_ends_the_lease(source: SourcePeer, sink: Any) -> None:
    handle = source.lease("req-empty")
    stats = sink.read_blocking(handle, [], [], timeout=WAIT_S)
    assert (stats.blocks, stats.bytes, stats.descriptors) == (0, 0, 0)
    source.wait_released("req-empty")


def test_unread_lease_expires_once(source: SourcePeer) -> None:
    source.lease("req-expire", ttl=0.5)
    later = time.time() + 5.0
    first = source.call(Command("poll", now=later))
    assert "req-expire" in first.expired and "req-expire" not in first.released
    assert "req-expire" not in source.call(Command("poll", now=later)).expired


def test_release_without_reading(source: SourcePeer, sink: Any) -> None:
    handle = source.lease("req-abort")
    sink.release(handle)
    source.wait_released("req-abort")


def test_expired_handle_is_refused(source: SourcePeer, sink: Any) -> None:
    handle = msgspec.structs.replace(source.lease("req-late"), lease_deadline=time.time() - 1)
    with pytest.raises(TransferError) as err:
        sink.read_blocking(handle, [0], [0], timeout=WAIT_S)
    assert err.value.outcome == "expired"
    sink.release(handle)
    source.wait_released("req-late")


@pytest.mark.parametrize(
    ("field", "change"),
    [
        ("dtype", {"dtype": "bfloat16", "element_size": 2}),
        ("head_dim", {"head_dim": 16}),
        ("wire_version", None),
    ],
)
def test_incompatible_peer_is_refused(
    source: SourcePeer, sink: Any, field: str, change: dict[str, Any] | None
) -> None:
    from transfer.compat import compat_hash

    info = source.info
    if change is None:
        info = msgspec.structs.replace(info, agent_name="other", wire_version=WIRE_VERSION + 1)
    else:
        layout = msgspec.structs.replace(info.layout, **change)
        info = msgspec.structs.replace(
            info, agent_name="other", layout=layout, compat_hash=compat_hash(layout)
        )
    with pytest.raises(IncompatibleKvError, match=field) as err:
        sink.connect(info)
    assert err.value.field == field
    sink.connect(source.info)  # the real peer stays connected (idempotent)


def test_injected_failure_then_success(source: SourcePeer, sink: Any) -> None:
    handle = source.lease("req-inject")
    sink.inject_failures(1)
    with pytest.raises(TransferError) as err:
        asyncio.run(sink.read(handle, [1], [3], timeout=WAIT_S))
    assert err.value.outcome == "injected"
    stats = asyncio.run(sink.read(handle, [1], [3], timeout=WAIT_S))
    assert stats.blocks == 1
    assert block_hashes(sink_kv(sink), [3]) == source.call(Command("hashes", block_ids=[1])).hashes
    source.wait_released("req-inject")


def test_injected_failure_rate_is_seeded(source: SourcePeer, sink: Any) -> None:
    """Each read fails with the rate's probability, drawn from Random(seed): the same reads every time."""
    import random

    draws = random.Random(7)
    expected = [draws.random() < 0.5 for _ in range(8)]
    assert any(expected) and not all(expected)
    sink.inject_failure_rate(0.5, seed=7)
    failed = []
    try:
        for i in range(8):
            handle = source.lease(f"req-rate-{i}")
            try:
                asyncio.run(sink.read(handle, [1], [3], timeout=WAIT_S))
                failed.append(False)
            except TransferError as exc:
                assert exc.outcome == "injected"
                failed.append(True)
                sink.release(handle)
            source.wait_released(f"req-rate-{i}")
    finally:
        sink.inject_failure_rate(0.0)
    assert failed == expected
    with pytest.raises(ValueError, match="within"):
        sink.inject_failure_rate(1.5)


def test_wire_round_trip(source: SourcePeer) -> None:
    assert unpack(pack(source.info), AgentInfo) == source.info
    assert SRC_LAYOUT.region_bytes == 2 * 4 * 2 * 8 * 4
    assert SRC_LAYOUT.total_bytes == 3 * 10 * SRC_LAYOUT.region_bytes



@pytest.mark.parametrize("read_threads", [0, 4])
def test_read_threads_move_exact_bytes(source: SourcePeer, read_threads: int) -> None:
    """One UCX thread (0), and a pool of 4 that splits the 6-descriptor read but not the 3-descriptor one."""
    from transfer.nixl_sink import KvSink

    sink = KvSink(torch.full(SINK_LAYOUT.shape, -7.0), SINK_LAYOUT, f"decode-threads-{read_threads}",
                  read_threads=read_threads)
    try:
        sink.connect(source.info)
        assert sink.read_threads == read_threads
        for remote, local in (([2, 5], [14, 0]), ([7], [9])):
            handle = source.lease(f"req-threads-{read_threads}-{local[0]}")
            before = sink_kv(sink).clone()
            stats = sink.read_blocking(handle, remote, local, timeout=WAIT_S)
            assert stats.descriptors == len(remote) * SRC_LAYOUT.num_layers
            expected = source.call(Command("hashes", block_ids=remote)).hashes
            assert block_hashes(sink_kv(sink), local) == expected
            untouched = [b for b in range(SINK_LAYOUT.num_blocks) if b not in local]
            assert torch.equal(sink_kv(sink)[:, untouched], before[:, untouched])
            source.wait_released(handle.request_id)
    finally:
        sink.close()


def test_no_lease_left_behind(source: SourcePeer) -> None:
    """Runs last: every lease above ended by read, release or expiry."""
    assert source.call(Command("poll")).num_leases == 0


def test_a_rank_with_other_heads_reads_through_staging_in_chunks(source: SourcePeer) -> None:
    """A sink holding KV head 1 of 2 (rank 1 of TP=2) from the unsharded source: each chunk of 3 blocks
    (the staging buffer's size) of the source's whole regions is staged, then head 1 copied; two reads at
    once take turns on the buffer, and each ends its lease."""
    from transfer.nixl_sink import KvSink

    layout = KvLayout("tiny", "float32", 3, 16, 4, 1, 8, 4).sharded(2, 1, 1, 2)
    per_block = SRC_LAYOUT.num_layers * SRC_LAYOUT.region_bytes
    sink = KvSink(torch.full(layout.shape, -7.0), layout, "decode-staged", staging_bytes=3 * per_block + 5)
    try:
        sink.connect(source.info)
        torch.manual_seed(0)
        want = torch.randn(SRC_LAYOUT.shape)[:, :, :, :, 1:2]  # the source's cache (source_main's seed)
        reads = [("req-staged-a", [9, 2, 3, 4, 5, 6, 7], [0, 1, 2, 3, 4, 5, 6]),
                 ("req-staged-b", [0, 1], [8, 9])]
        handles = [source.lease(rid) for rid, _, _ in reads]

        async def both() -> list[Any]:
            return await asyncio.gather(*(sink.read(h, remote, local, timeout=WAIT_S)
                                          for h, (_, remote, local) in zip(handles, reads, strict=True)))

        stats = asyncio.run(both())
        kv = sink._kv_cache
        for (_, remote, local), got in zip(reads, stats, strict=True):
            assert torch.equal(kv[:, local], want[:, remote])
            assert got.bytes == len(local) * SRC_LAYOUT.num_layers * layout.region_bytes
            assert got.staged_bytes == len(local) * per_block  # both source heads read, one kept
        source.wait_released(*(rid for rid, _, _ in reads))
        # [9, 2, 3] [4, 5, 6] [7]: 2 + 1 + 1 runs of consecutive source blocks, one descriptor per layer
        assert stats[0].descriptors == 4 * SRC_LAYOUT.num_layers
        assert stats[1].descriptors == SRC_LAYOUT.num_layers
        assert torch.equal(kv[:, 10:], torch.full_like(kv[:, 10:], -7.0))
    finally:
        sink.close()

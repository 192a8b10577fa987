"""NIXL READ between two processes' CUDA KV caches (VRAM to VRAM over UCX): the listed blocks arrive
bit for bit, no other block is written. Skips without CUDA, or without NIXL's and msgspec's wheels."""

from __future__ import annotations

import multiprocessing as mp
import time
from multiprocessing.connection import Connection

import pytest
import torch

pytest.importorskip("nixl", reason="NIXL's wheels are not installed (docs/gpu.md: carry them)")
pytest.importorskip("msgspec", reason="msgspec's wheel is not installed (docs/gpu.md: carry it with NIXL's)")

from messages.codec import pack, unpack  # noqa: E402 - after the skips: the device image may lack both
from transfer.wire import AgentInfo, KvHandle, KvLayout  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

LAYOUT = KvLayout("vram-test", "bfloat16", 4, 32, 16, 2, 64, 2)  # 1 MiB of bf16 KV
WAIT_S = 60.0


def source_main(conn: Connection) -> None:
    from transfer.nixl_source import KvSource

    torch.manual_seed(0)
    kv = torch.randn(LAYOUT.shape, device="cuda").to(torch.bfloat16)
    source = KvSource(kv, LAYOUT, "prefill-vram")
    conn.send_bytes(pack(source.agent_info()))
    conn.send_bytes(kv.cpu().view(torch.int16).numpy().tobytes())
    while not conn.poll(0.01):
        source.poll()
    source.close()


def test_vram_read_moves_exact_bytes_and_only_listed_blocks() -> None:
    from transfer.nixl_sink import KvSink

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=source_main, args=(child,), daemon=True)
    proc.start()
    try:
        assert parent.poll(WAIT_S), "source process did not start"
        info = unpack(parent.recv_bytes(), AgentInfo)
        want = torch.frombuffer(bytearray(parent.recv_bytes()), dtype=torch.int16).view(LAYOUT.shape)
        assert info.mem_type == "VRAM"
        kv = torch.zeros(LAYOUT.shape, dtype=torch.bfloat16, device="cuda")
        sink = KvSink(kv, LAYOUT, "decode-vram")
        sink.connect(info)
        remote, local = [3, 7, 8, 20], [0, 1, 5, 30]
        handle = KvHandle("r-vram", info.agent_name, remote, 4 * LAYOUT.block_size, info.compat_hash,
                          time.time() + WAIT_S)
        stats = sink.read_blocking(handle, remote, local, timeout=WAIT_S)
        torch.cuda.synchronize()
        got = kv.cpu().view(torch.int16)
        assert stats.bytes == 4 * LAYOUT.num_layers * LAYOUT.region_bytes
        for r, lo in zip(remote, local, strict=True):
            assert torch.equal(got[:, lo], want[:, r]), (r, lo)
        untouched = [b for b in range(LAYOUT.num_blocks) if b not in local]
        assert not got[:, untouched].any()
        sink.close()
        parent.send_bytes(b"stop")
        proc.join(10)
    finally:
        if proc.is_alive():
            proc.kill()

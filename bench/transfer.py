"""KV transfer throughput: NIXL READ between two processes against a plain memory copy.

A spawned child process holds the source KV caches (``KvSource``); this process
reads from them with ``KvSink.read_blocking`` (timed from posting the READ to DONE,
notification included). Each case also times ``torch`` ``copy_`` of a same-size
tensor in this process, so the READ rate is reported as a fraction of a plain copy
measured in the same run. Every pool holds twice the blocks a request needs; a
"contiguous" read maps blocks 0..n-1 onto 0..n-1 (NIXL merges them into one
descriptor per layer), a "scattered" read uses random distinct blocks on both sides.

    python -m bench.transfer [--repeats 5] [--json OUT]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import multiprocessing as mp
import platform
import random
import statistics
import time
from multiprocessing.connection import Connection

import msgspec
import torch

from transfer.wire import AgentInfo, KvHandle, KvLayout, decode, encode

WAIT_S = 60.0


def smollm2_layout(dtype: torch.dtype, tokens: int) -> tuple[KvLayout, int]:
    blocks = tokens // 16
    layout = KvLayout(
        "SmolLM2-135M",
        str(dtype).removeprefix("torch."),
        30,
        2 * blocks,
        16,
        3,
        64,
        torch.empty(0, dtype=dtype).element_size(),
    )
    return layout, blocks


def cases() -> list[tuple[str, KvLayout, int]]:
    fp32, n32 = smollm2_layout(torch.float32, 2048)
    bf16, n16 = smollm2_layout(torch.bfloat16, 2048)
    mib64 = KvLayout("synthetic", "bfloat16", 16, 128, 16, 8, 128, 2)  # 64 KiB regions, 64 blocks = 64 MiB
    return [("SmolLM2 2048 tok fp32", fp32, n32), ("SmolLM2 2048 tok bf16", bf16, n16), ("64 MiB", mib64, 64)]


class Row(msgspec.Struct):
    case: str
    mode: str
    bytes: int
    descriptors: int
    read_min_s: float
    read_median_s: float
    copy_min_s: float
    copy_median_s: float
    memmove_median_s: float

    def gbps(self, seconds: float) -> float:
        return self.bytes / seconds / 1e9


def source_main(conn: Connection) -> None:
    from transfer.nixl_source import KvSource

    sources = []
    for i, (_, layout, _) in enumerate(cases()):
        kv = torch.randn(layout.shape).to(getattr(torch, layout.dtype))
        sources.append(KvSource(kv, layout, f"bench-source-{i}"))
    conn.send_bytes(encode([s.agent_info() for s in sources]))
    while not conn.poll(0.01):
        for source in sources:
            source.poll()
    for source in sources:
        source.close()


def time_copy(nbytes: int, repeats: int, single_thread: bool = False) -> list[float]:
    """``torch`` ``copy_`` (all torch threads), or one ``memmove`` call (one thread) when asked."""
    src, dst = torch.randint(0, 255, (nbytes,), dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        if single_thread:
            ctypes.memmove(dst.data_ptr(), src.data_ptr(), nbytes)
        else:
            dst.copy_(src)
        times.append(time.perf_counter() - start)
    return times


def run_case(name: str, info: AgentInfo, blocks: int, repeats: int) -> list[Row]:
    from transfer.nixl_sink import KvSink

    layout = info.layout
    sink = KvSink(torch.zeros(layout.shape, dtype=getattr(torch, layout.dtype)), layout, f"bench-sink-{name}")
    sink.connect(info)
    rng = random.Random(0)
    rows = []
    for mode in ("contiguous", "scattered"):
        if mode == "contiguous":
            remote = local = list(range(blocks))
        else:
            remote = rng.sample(range(layout.num_blocks), blocks)
            local = rng.sample(range(layout.num_blocks), blocks)
        reads = []
        for i in range(repeats + 1):
            handle = KvHandle(
                f"{name}-{mode}-{i}",
                info.agent_name,
                remote,
                blocks * 16,
                info.compat_hash,
                time.time() + WAIT_S,
            )
            stats = sink.read_blocking(handle, remote, local, timeout=WAIT_S)
            reads.append(stats.seconds)
        copies = time_copy(stats.bytes, repeats)
        rows.append(
            Row(
                name,
                mode,
                stats.bytes,
                stats.descriptors,
                min(reads[1:]),
                statistics.median(reads[1:]),
                min(copies),
                statistics.median(copies),
                statistics.median(time_copy(stats.bytes, repeats, single_thread=True)),
            )
        )
    sink.close()
    return rows


def markdown(rows: list[Row]) -> str:
    lines = [
        "| case | read | MiB | descriptors | READ min / median ms | READ GB/s (median) "
        "| copy_ GB/s (median) | READ / copy_ | memmove GB/s (median) | READ / memmove |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.case} | {r.mode} | {r.bytes / 2**20:.1f} | {r.descriptors} "
            f"| {r.read_min_s * 1e3:.1f} / {r.read_median_s * 1e3:.1f} | {r.gbps(r.read_median_s):.2f} "
            f"| {r.gbps(r.copy_median_s):.2f} | {r.copy_median_s / r.read_median_s:.0%} "
            f"| {r.gbps(r.memmove_median_s):.2f} | {r.memmove_median_s / r.read_median_s:.0%} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description="NIXL KV READ throughput against a plain memory copy.")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", dest="json_out", default=None, help="write the rows as JSON here")
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=source_main, args=(child,), daemon=True)
    proc.start()
    try:
        if not parent.poll(WAIT_S):
            raise TimeoutError("source process did not start")
        infos = decode(parent.recv_bytes(), list[AgentInfo])
        rows = [
            row
            for (name, _, n), info in zip(cases(), infos, strict=True)
            for row in run_case(name, info, n, args.repeats)
        ]
        parent.send_bytes(b"stop")
        proc.join(10)
    finally:
        if proc.is_alive():
            proc.kill()
    print(
        f"NIXL READ (UCX) vs torch copy_, {platform.node()}, {torch.get_num_threads()} torch threads, "
        f"{args.repeats} repeats"
    )
    print(markdown(rows))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump([msgspec.to_builtins(r) for r in rows], f, indent=2)


if __name__ == "__main__":
    main()

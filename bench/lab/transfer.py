"""KV transfer throughput: NIXL READ between two processes against a plain memory copy.

A spawned child process holds the source KV caches (``KvSource``); this process
reads from them with ``KvSink.read_blocking`` (timed from posting the READ to DONE,
notification included; the process CPU time of the READ, all threads, is kept too).
Each case also times, in the same run and interleaved with
the READs (one of each per repeat), one ``memmove`` call (one thread, a plain memory
copy) and ``torch`` ``copy_`` (all torch threads) of the same number of bytes, so
the READ rate is reported as a fraction of a plain copy measured under the same
machine load. Every pool holds twice the blocks a request needs; a "contiguous" read
maps blocks 0..n-1 onto 0..n-1 (NIXL merges them into one descriptor per layer), a
"scattered" read uses random distinct blocks on both sides. ``--read-threads``
lists the sink configurations to compare (``KvSink(read_threads=...)``; ``default``
is what a decode worker uses here).

``--device cuda`` puts both processes' caches on the GPU (NIXL VRAM to VRAM over UCX); the
comparison is then the device's own copy (``copy_`` between two device buffers, synchronized),
reported in both copy columns since there is no host ``memmove`` of device memory.

    python -m bench.lab.transfer [--repeats 7] [--read-threads 0,default] [--device cpu|cuda] [--json OUT]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import multiprocessing as mp
import os
import platform
import random
import statistics
import time
from multiprocessing.connection import Connection

import msgspec
import torch

from messages.codec import pack, unpack
from transfer.agent import default_read_threads
from transfer.wire import AgentInfo, KvHandle, KvLayout

WAIT_S = 60.0
SETTLE_S = 0.05


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
    read_threads: int
    bytes: int
    descriptors: int
    read_min_s: float
    read_median_s: float
    copy_min_s: float
    copy_median_s: float
    memmove_median_s: float
    read_cpu_median_s: float
    memmove_cpu_median_s: float

    def gbps(self, seconds: float) -> float:
        return self.bytes / seconds / 1e9


def source_main(conn: Connection, device: str = "cpu") -> None:
    from transfer.nixl_source import KvSource

    sources = []
    for i, (_, layout, _) in enumerate(cases()):
        kv = torch.randn(layout.shape, device=device).to(getattr(torch, layout.dtype))
        # progressed as a prefill worker's source is while it lends blocks (no leases are taken here)
        sources.append(KvSource(kv, layout, f"bench-source-{i}", always_in_flight=True))
    conn.send_bytes(pack([s.agent_info() for s in sources]))
    while not conn.poll(0.01):
        for source in sources:
            source.poll()
    for source in sources:
        source.close()


class Copier:
    """A same-size source and destination; ``time(single_thread)`` times one copy."""

    def __init__(self, nbytes: int, device: str = "cpu") -> None:
        self.src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
        self.dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self.dst.copy_(self.src)
        self.cuda = self.src.is_cuda

    def time(self, single_thread: bool) -> tuple[float, float]:
        """Wall and process CPU seconds of ``torch`` ``copy_`` (all torch threads), or of one
        ``memmove`` call (one thread); on CUDA both are the device's ``copy_``, synchronized."""
        if self.cuda:
            torch.cuda.synchronize()
        cpu, start = time.process_time(), time.perf_counter()
        if single_thread and not self.cuda:
            ctypes.memmove(self.dst.data_ptr(), self.src.data_ptr(), self.src.numel())
        else:
            self.dst.copy_(self.src)
            if self.cuda:
                torch.cuda.synchronize()
        return time.perf_counter() - start, time.process_time() - cpu


def run_case(name: str, info: AgentInfo, blocks: int, repeats: int, thread_counts: list[int],
             device: str = "cpu") -> list[Row]:
    from transfer.nixl_sink import KvSink

    layout = info.layout
    sinks = []
    for threads in thread_counts:
        sink = KvSink(torch.zeros(layout.shape, dtype=getattr(torch, layout.dtype), device=device), layout,
                      f"bench-sink-{name}-{threads}", read_threads=threads)
        sink.connect(info)
        sinks.append(sink)
    rng = random.Random(0)
    rows = []
    for mode in ("contiguous", "scattered"):
        if mode == "contiguous":
            remote = local = list(range(blocks))
        else:
            remote = rng.sample(range(layout.num_blocks), blocks)
            local = rng.sample(range(layout.num_blocks), blocks)
        reads: list[list[float]] = [[] for _ in sinks]
        read_cpu: list[list[float]] = [[] for _ in sinks]
        copies: list[float] = []
        memmoves: list[tuple[float, float]] = []
        copier = None
        for i in range(repeats + 1):  # round 0 warms up and is dropped
            for j, sink in enumerate(sinks):
                handle = KvHandle(f"{name}-{mode}-{j}-{i}", info.agent_name, remote, blocks * 16,
                                  info.compat_hash, time.time() + WAIT_S)
                cpu = time.process_time()
                stats = sink.read_blocking(handle, remote, local, timeout=WAIT_S)
                read_cpu[j].append(time.process_time() - cpu)
                reads[j].append(stats.seconds)
            copier = copier or Copier(stats.bytes, device)
            memmoves.append(copier.time(single_thread=True))
            copies.append(copier.time(single_thread=False)[0])
            # torch's OpenMP workers spin for a few ms after copy_ (libgomp's default spin
            # count); left running they take a core from the next READ (measured: the first
            # READ of each round lost up to a third of its speed). Untimed.
            time.sleep(SETTLE_S)
        for threads, times, cpus in zip(thread_counts, reads, read_cpu, strict=True):
            rows.append(Row(name, mode, threads, stats.bytes, stats.descriptors, min(times[1:]),
                            statistics.median(times[1:]), min(copies[1:]), statistics.median(copies[1:]),
                            statistics.median(m[0] for m in memmoves[1:]), statistics.median(cpus[1:]),
                            statistics.median(m[1] for m in memmoves[1:])))
    for sink in sinks:
        sink.close()
    return rows


def markdown(rows: list[Row]) -> str:
    lines = [
        "| case | read | MiB | descriptors | read threads | READ min / median ms | READ GB/s (median) "
        "| memmove GB/s (median) | READ / memmove | copy_ GB/s (median) | READ / copy_ "
        "| READ CPU s / memmove CPU s |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.case} | {r.mode} | {r.bytes / 2**20:.1f} | {r.descriptors} | {r.read_threads} "
            f"| {r.read_min_s * 1e3:.1f} / {r.read_median_s * 1e3:.1f} | {r.gbps(r.read_median_s):.2f} "
            f"| {r.gbps(r.memmove_median_s):.2f} | {r.memmove_median_s / r.read_median_s:.0%} "
            f"| {r.gbps(r.copy_median_s):.2f} | {r.copy_median_s / r.read_median_s:.0%} "
            f"| {r.read_cpu_median_s / r.memmove_cpu_median_s:.2f} |"
        )
    return "\n".join(lines)


def thread_counts(text: str, mem_type: str = "DRAM") -> list[int]:
    """``--read-threads``: comma-separated counts >= 0 or ``default``."""
    counts = []
    for part in text.split(","):
        part = part.strip()
        if part == "default":
            counts.append(default_read_threads(mem_type))
        elif part.isdigit():
            counts.append(int(part))
        else:
            raise argparse.ArgumentTypeError(f"--read-threads takes counts >= 0 or 'default', got {part!r}")
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description="NIXL KV READ throughput against a plain memory copy.")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--read-threads", default="0,default",
                        help="sink read-thread counts to compare, e.g. 0,2 (default: 0,default)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="where both caches live: cpu (DRAM) or cuda (VRAM to VRAM; default: cpu)")
    parser.add_argument("--json", dest="json_out", default=None, help="write the rows as JSON here")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here")
    try:
        counts = thread_counts(args.read_threads, "VRAM" if args.device == "cuda" else "DRAM")
    except argparse.ArgumentTypeError as exc:
        parser.error(str(exc))
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=source_main, args=(child, args.device), daemon=True)
    proc.start()
    load_before = os.getloadavg()
    try:
        if not parent.poll(WAIT_S):
            raise TimeoutError("source process did not start")
        infos = unpack(parent.recv_bytes(), list[AgentInfo])
        rows = [
            row
            for (name, _, n), info in zip(cases(), infos, strict=True)
            for row in run_case(name, info, n, args.repeats, counts, args.device)
        ]
        parent.send_bytes(b"stop")
        proc.join(10)
    finally:
        if proc.is_alive():
            proc.kill()
    load_after = os.getloadavg()
    print(
        f"NIXL READ (UCX, {'VRAM' if args.device == 'cuda' else 'DRAM'}) vs memmove and torch copy_, "
        f"{platform.node()}, {os.cpu_count()} cores, "
        f"{torch.get_num_threads()} torch threads, {args.repeats} repeats, "
        f"load average {load_before[0]:.2f} before / {load_after[0]:.2f} after"
    )
    print(markdown(rows))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump([msgspec.to_builtins(r) for r in rows], f, indent=2)


if __name__ == "__main__":
    main()

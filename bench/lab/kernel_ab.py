"""The native kernels of two source trees in one process, calls alternated: a change's effect on a host
whose speed moves between runs.

On a shared host the same product can take 17 ms in one minute and 23 ms in the next, so two runs one
after the other cannot show a 5-10% change. This builds the native library (its ``kernels/cpu_*.c``
files, ``kernels/cpu_native.py``'s flags) from ``--base``, a git revision, beside the working tree's own
build, loads both, and times each case with the two libraries in turn, swapping which goes first every
repeat, so a slow spell hits both alike. It reports each side's best and median and the ratio of the
medians (base / tree: above 1 means the working tree is faster).

Cases, on SmolLM2-135M's shapes (hidden 576, 9 query and 3 KV heads of 64, intermediate 1536) with random
weights: ``products`` (one layer's four products, int8 activations over Q4_1 blocks, at ``--rows``),
``head`` (the LM head's Q8_0 product, 49,152 x 576, at the same rows), ``attention`` (one layer's
attention over a ``--prompt``-token prompt chunk, float32 cache) and ``prefill`` (the default model's
one-call decoder, int8 activations, over a ``--prompt``-token prompt: every layer of the step, the
engine's own forward with each build's ``pdserve_decoder_f32``).

    python -m bench.lab.kernel_ab --base HEAD~1 [--rows 16,1024] [--prompt 1024] [--threads 2]
        [--repeats 12] [--cases products,head,attention,prefill]
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType

from bench.lab.kquants import quantize_any
from bench.lab.step_profile import start_scenario
from engine.config import EngineConfig
from engine.engine import LLMEngine
from kernels.attention import AttentionMetadata
from kernels.cpu_native import CFLAGS, SOURCES, NativeCpuAttentionBackend, bind_ops, load_library
from kernels.gguf_blocks import BlockKind, BlockMatrix
from kernels.native_ops import native_ops

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE, VOCAB = 576, 9, 3, 64, 1536, 49152
LAYER = ((HIDDEN + 2 * KV_HEADS * HEAD_DIM, HIDDEN), (HIDDEN, HIDDEN), (2 * INTERMEDIATE, HIDDEN),
         (HIDDEN, INTERMEDIATE))  # (out, in): fused QKV, output, fused gate/up, down


def build_base(revision: str, directory: Path) -> ctypes.CDLL:
    """The native library compiled from ``revision``'s own ``kernels/cpu_*.c`` and ``cpu_*.h`` files (every
    such file is a part of the library), with the working tree's flags."""
    root = Path(subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True,
                               check=True, cwd=SOURCES[0].parent).stdout.strip())
    folder = SOURCES[0].parent.relative_to(root).as_posix()
    listed = subprocess.run(["git", "ls-tree", "--name-only", f"{revision}:{folder}"], capture_output=True,
                            text=True, cwd=root)
    if listed.returncode != 0:
        raise SystemExit(f"--base {revision}: {listed.stderr.strip()}")
    names = [n for n in listed.stdout.split() if n.startswith("cpu_") and n.endswith((".c", ".h"))]
    for name in names:
        shown = subprocess.run(["git", "show", f"{revision}:{folder}/{name}"], capture_output=True,
                               check=True, cwd=root)
        (directory / name).write_bytes(shown.stdout)
    out = directory / "base.so"
    subprocess.run(["gcc", *CFLAGS, "-o", str(out), *(n for n in names if n.endswith(".c"))], cwd=directory,
                   check=True)
    lib = ctypes.CDLL(str(out))
    bind_ops(lib)
    return lib


def alternate(run: dict[str, Callable[[], None]], repeats: int) -> dict[str, list[float]]:
    """Each side's seconds per call, the sides in turn and their order swapped every repeat."""
    names = list(run)
    for fn in run.values():
        fn()  # warm
    times: dict[str, list[float]] = {name: [] for name in names}
    for rep in range(repeats):
        for name in names if rep % 2 == 0 else names[::-1]:
            t0 = time.perf_counter()
            run[name]()
            times[name].append(time.perf_counter() - t0)
    return times


def per_build(libs: dict[str, ctypes.CDLL], holder: object, attr: str, symbol: str,
              body: Callable[[], object]) -> dict[str, Callable[[], None]]:
    """For each build, a run that points ``holder.attr`` (a ctypes function) at that build's ``symbol``,
    with the same argument types, then runs ``body``."""
    own = getattr(holder, attr)

    def side(lib: ctypes.CDLL) -> Callable[[], None]:
        fn = getattr(lib, symbol)
        fn.argtypes, fn.restype = own.argtypes, own.restype

        def run() -> None:
            setattr(holder, attr, fn)
            body()
        return run
    return {name: side(lib) for name, lib in libs.items()}


def packed(kind: BlockKind, out: int, inp: int, rng: np.random.Generator) -> torch.Tensor:
    ops = native_ops()
    assert ops is not None
    raw = quantize_any(rng.standard_normal((out, inp), dtype=np.float32), GGMLQuantizationType[kind.name])
    return ops.qpack(BlockMatrix(kind, torch.from_numpy(raw.copy()), inp))


def product_case(libs: dict[str, ctypes.CDLL], shapes: tuple[tuple[int, int], ...], kind: BlockKind,
                 rows: int, rng: np.random.Generator) -> dict[str, Callable[[], None]]:
    ops = native_ops()
    assert ops is not None
    mats = [(packed(kind, out, inp, rng), out, torch.randn(rows, inp)) for out, inp in shapes]

    def body() -> None:
        for weight, out, x in mats:
            ops.qpacked_linear(x, weight, kind, out, None, int8=True)
    return per_build(libs, ops, "_qpacked", "pdserve_qpacked_f32", body)


def attention_case(libs: dict[str, ctypes.CDLL], tokens: int) -> dict[str, Callable[[], None]]:
    block = 16
    blocks = -(-tokens // block)
    backend = NativeCpuAttentionBackend()
    backend.prepare(AttentionMetadata.build(block, [tokens], [tokens], [list(range(blocks))]))
    cache = torch.zeros(blocks, 2, block, KV_HEADS, HEAD_DIM)
    q, k, v = (torch.randn(tokens, heads, HEAD_DIM) for heads in (HEADS, KV_HEADS, KV_HEADS))
    return per_build(libs, backend, "_kernel", "pdserve_paged_attention",
                     lambda: backend.forward(q, k, v, cache, HEAD_DIM ** -0.5))


def prefill_case(libs: dict[str, ctypes.CDLL], tokens: int, threads: int) -> dict[str, Callable[[], None]]:
    config = EngineConfig(enable_prefix_caching=False, max_num_batched_tokens=max(tokens, 2048),
                          kv_cache_memory=1024**3, num_threads=threads, gguf_activations="int8")
    engine = LLMEngine(None, config)
    decoder = engine.runner.model.native_decoder
    if decoder is None:
        raise SystemExit("prefill: the default model takes no one-call decoder here")

    def body() -> None:
        start_scenario(engine, 1, tokens)
        out = engine.scheduler.schedule()
        engine.runner.run(engine.runner.prepare(out, engine.kv))
        engine.process(out, None)
    return per_build(libs, decoder, "_call", "pdserve_decoder_f32", body)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True, help="the git revision whose kernels are compared")
    parser.add_argument("--rows", default="16,1024")
    parser.add_argument("--prompt", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=12)
    parser.add_argument("--cases", default="products,head,attention,prefill")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    own = load_library()
    if own is None or native_ops() is None:
        raise SystemExit("no native library here")
    rng = np.random.default_rng(0)
    cases = args.cases.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        libs = {"base": build_base(args.base, Path(tmp)), "tree": own}
        print(f"base {args.base} against the working tree; {args.threads} threads, {args.repeats} repeats")
        print("| case | base best | base median | tree best | tree median | base / tree (medians) |")
        print("|---|---:|---:|---:|---:|---:|")
        todo: list[tuple[str, dict[str, Callable[[], None]]]] = []
        for rows in map(int, args.rows.split(",")):
            if "products" in cases:
                todo.append((f"layer products, Q4_1 int8, {rows} rows",
                              product_case(libs, LAYER, BlockKind.Q4_1, rows, rng)))
            if "head" in cases:
                todo.append((f"LM head, Q8_0 int8, {rows} rows",
                             product_case(libs, ((VOCAB, HIDDEN),), BlockKind.Q8_0, rows, rng)))
        if "attention" in cases:
            todo.append((f"attention, {args.prompt}-token prompt", attention_case(libs, args.prompt)))
        if "prefill" in cases:
            todo.append((f"prompt step, {args.prompt} tokens, one-call decoder",
                         prefill_case(libs, args.prompt, args.threads)))
        for label, run in todo:
            times = alternate(run, args.repeats)
            base, tree = (sorted(times[name]) for name in ("base", "tree"))
            mb, mt = statistics.median(base), statistics.median(tree)
            cells = (base[0], mb, tree[0], mt)
            print(f"| {label} | " + " | ".join(f"{c * 1e3:.2f}" for c in cells) + f" | {mb / mt:.2f} |")


if __name__ == "__main__":
    main()

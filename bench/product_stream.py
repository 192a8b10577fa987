"""How fast the native packed product streams a decode step's weights, against a plain ``sum``.

Every product of the default model's shapes (per layer: fused QKV, output, fused gate/up, down; then
the LM head), at one activation row, in a decode step's order, against a ``sum`` over the same bytes
and one product over a single weight of the same size (best of ``--repeats``, no profiler). The gap
between "one long product" and the ``sum`` is the kernel's; between the step's products and the one
long product, the per-call cost. ``--rows 1,10,16`` adds the step's products at each of those
activation row counts (a decode step of that batch), with the arithmetic rate they reached.

    python -m bench.product_stream [--threads 2] [--repeats 7] [--layers 30] [--rows 1,10,16]

It reads the weights through 2 MB pages, as the serving workers do (``bench/__init__.py`` turns
torch's ``THP_MEM_ALLOC_ENABLE`` on; ``THP_MEM_ALLOC_ENABLE=0`` turns it off).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from kernels.native_ops import native_ops

HIDDEN, INTER, VOCAB, QKV = 576, 1536, 49152, 960  # SmolLM2-135M


def best(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.product_stream", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--rows", default="", help="comma-separated activation row counts for the step's "
                        "products (default: none beyond the one-row table)")
    args = parser.parse_args(argv)
    try:
        row_counts = [int(r) for r in args.rows.split(",") if r.strip()]
    except ValueError:
        raise SystemExit(f"--rows: comma-separated integers expected, got {args.rows!r}") from None
    if any(r < 1 for r in row_counts):
        raise SystemExit(f"--rows: row counts must be at least 1, got {args.rows!r}")
    ops = native_ops()
    if ops is None:
        raise SystemExit("the native kernels are unavailable here (no C compiler, or "
                         "PDSERVE_NATIVE_KERNELS=0)")
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    shapes = [s for _ in range(args.layers)
              for s in ((QKV, HIDDEN), (HIDDEN, HIDDEN), (2 * INTER, HIDDEN), (HIDDEN, INTER))]
    # (packed weight, output features), packed once as the engine does
    weights = [(ops.pack(w), w.shape[0]) for w in (torch.randn(*s, generator=gen)
                                                   for s in [*shapes, (VOCAB, HIDDEN)])]
    total = sum(p.numel() * 4 for p, _ in weights)
    one_rows = total // 4 // HIDDEN
    one = ops.pack(torch.randn(one_rows, HIDDEN, generator=gen))
    flat = torch.randn(total // 4, generator=gen)
    x, xi = torch.randn(1, HIDDEN, generator=gen), torch.randn(1, INTER, generator=gen)

    def step() -> None:
        for p, n in weights:
            ops.packed_linear(xi if p.shape[1] == INTER else x, p, n, None)

    head, vocab = weights[-1]
    rows = [("sum", best(flat.sum, args.repeats), total),
            (f"one {one_rows} x {HIDDEN} product", best(lambda: ops.packed_linear(x, one, one_rows, None),
                                                        args.repeats), total),
            ("LM head alone", best(lambda: ops.packed_linear(x, head, vocab, None), args.repeats),
             head.numel() * 4),
            (f"{len(weights)} products", best(step, args.repeats), total)]
    print(f"{total / 1e6:.0f} MB of weights, {args.threads} threads, best of {args.repeats}")
    for name, seconds, nbytes in rows:
        print(f"{name:>28}: {seconds * 1000:7.2f} ms  {nbytes / seconds / 1e9:5.1f} GB/s")
    for count in row_counts:
        xr, xir = torch.randn(count, HIDDEN, generator=gen), torch.randn(count, INTER, generator=gen)

        def step_rows(xr: torch.Tensor = xr, xir: torch.Tensor = xir) -> None:
            for p, n in weights:
                ops.packed_linear(xir if p.shape[1] == INTER else xr, p, n, None)

        seconds = best(step_rows, args.repeats)
        flops = 2 * count * total / 4
        print(f"{f'{len(weights)} products, {count} rows':>28}: {seconds * 1000:7.2f} ms  "
              f"{total / seconds / 1e9:5.1f} GB/s  {flops / seconds / 1e9:5.0f} GFLOP/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

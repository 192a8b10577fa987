"""Every candidate CPU product for the model's linear shapes, per row count, side by side.

For each decoder shape (QKV, output, gate/up, down) and the LM head, and each row
count, times (best of ``--repeats``, candidates interleaved so load hits all alike):

- ``plain``: ``F.linear`` (torch's default);
- ``mkl_packed``: MKL packed SGEMM with the weight packed for exactly that row count;
- ``onednn``: oneDNN inner product (``torch.ops.mkldnn._linear_pointwise``);
- ``mm_t``: ``x @ w_t`` with the weight stored transposed (``[in, out]``);
- ``native``: ``kernels.native_ops.NativeOps.packed_linear`` on the weight packed once
  (what ``--linear-kernel native``, the default, runs at every row count);
- ``prepared``: ``kernels.linear.PreparedLinear`` with ``--linear-kernel prepacked`` (MKL's
  packed product at one row, oneDNN's up to 64, ``LARGE_PRODUCT``'s above).

and the per-step total (every layer's four products plus the LM head).

    python -m bench.lab.linear_kernels [--model PATH] [--rows 1,2,4,8,16,32,64] [--repeats 20]
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from engine.config import ModelConfig
from engine.loader import load_model_source, resolve_model
from kernels.linear import PreparedLinear, mkl_linear, mkl_pack, onednn_linear
from kernels.native_ops import native_ops

CANDIDATES = ("plain", "mkl_packed", "onednn", "mm_t", "native", "prepared")



def layer_shapes(cfg: ModelConfig) -> list[tuple[int, int]]:
    """``(in, out)`` of one decoder layer's linear layers: fused QKV, output, fused gate/up, down."""
    h, kv = cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim
    q = cfg.num_heads * cfg.head_dim
    return [(h, q + 2 * kv), (q, h), (h, 2 * cfg.intermediate_size), (cfg.intermediate_size, h)]

def best_of(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Best seconds per callable, calls interleaved round-robin after one warm-up each."""
    for fn in fns.values():
        fn()
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def candidates(x: torch.Tensor, w: torch.Tensor, w_t: torch.Tensor,
               prepared: PreparedLinear) -> dict[str, Callable[[], object]]:
    """Every candidate product of ``x`` (``m`` rows) with ``w``, as zero-argument calls."""
    m = x.shape[0]
    packed = mkl_pack(w, m)
    fns: dict[str, Callable[[], object]] = {
        "plain": lambda: F.linear(x, w),
        "mkl_packed": lambda: mkl_linear(x, packed, w, None, m),
        "onednn": lambda: onednn_linear(x, w, None),
        "mm_t": lambda: torch.mm(x, w_t),
        "prepared": lambda: prepared(x),
    }
    ops = native_ops()
    if ops is not None:
        panels = ops.pack(w)
        fns["native"] = lambda: ops.packed_linear(x, panels, w.shape[0], None)
    return fns


def sweep_shape(out_f: int, in_f: int, rows: list[int], repeats: int) -> dict[int, dict[str, float]]:
    """Best seconds per candidate for an ``[out_f, in_f]`` weight at each row count."""
    w = torch.randn(out_f, in_f) * 0.02
    w_t = w.t().contiguous()
    prepared = PreparedLinear(w, None, "prepacked")
    result = {}
    with torch.inference_mode():
        for m in rows:
            times = best_of(candidates(torch.randn(m, in_f), w, w_t, prepared), repeats)
            result[m] = {c: times.get(c, float("inf")) for c in CANDIDATES}
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--rows", default="1,2,4,8,16,32,64")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    cfg = load_model_source(resolve_model(args.model)).config
    rows = [int(r) for r in args.rows.split(",")]
    shapes = {f"{n}x{k}": (n, k) for k, n in layer_shapes(cfg)}
    shapes["lm_head"] = (cfg.vocab_size, cfg.hidden_size)
    table = {name: sweep_shape(n, k, rows, args.repeats) for name, (n, k) in shapes.items()}
    print(f"torch threads: {torch.get_num_threads()}; best ms of {args.repeats}")
    for m in rows:
        total = dict.fromkeys(CANDIDATES, 0.0)
        for name, per_rows in table.items():
            times = per_rows[m]
            weight = 1 if name == "lm_head" else cfg.num_layers
            for c in CANDIDATES:
                total[c] += weight * times[c]
            cells = "  ".join(f"{c} {times[c] * 1e3:7.3f}" for c in CANDIDATES)
            print(f"rows {m:4d} {name:>10}: {cells}")
        cells = "  ".join(f"{c} {total[c] * 1e3:7.2f}" for c in CANDIDATES)
        print(f"rows {m:4d}   per step: {cells}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"threads": torch.get_num_threads(), "table": table}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""One decoder layer's four products in each weight format the native kernels hold, beside the read floor.

The default model (SmolLM2-135M) has no matrix llama.cpp's K formats fit (their super-blocks need input
widths that are multiples of 256; its 576 is not), so this times a layer of a larger model's shapes on
random weights: by default Llama-3.2-1B's (hidden 2048, 32 query heads and 8 KV heads of 64, intermediate
8192; ``--shape HIDDEN,HEADS,KV_HEADS,HEAD_DIM,INTERMEDIATE``). Formats: ``float32`` (the packed panels),
``bf16`` (``--dtype bfloat16``'s panels), ``Q4_0``, ``Q4_1``, ``Q5_0``, ``Q5_1``, ``Q8_0``, ``Q4_K``,
``Q5_K``, ``Q6_K`` (every matrix in that type), ``Q4_K_M`` (llama.cpp's mix where a layer gets the more
bits: Q and K in Q4_K with V in Q6_K, so the fused QKV is ``KMIX``; the output and gate/up in Q4_K, down
in Q6_K) and ``fp8`` (an fp8 checkpoint's e4m3 codes over 128 x 128 block scales, as DeepSeek's, kept as
``FP8``).

For each row count, the layer's products (fused QKV, output, fused gate/up, down) are timed, best of
``--repeats``, the formats interleaved so load hits all alike, with float32 activations and, for the block
GGUF formats, int8 ones (``--gguf-activations int8``). ``floor`` = the bytes the format holds / the read
bandwidth of a torch ``sum`` over ``--bw-bytes``, measured in the same run.

    python -m bench.lab.block_products [--rows 1,16] [--repeats 10] [--threads 2] [--shape ...]
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import numpy as np
import torch
from gguf import GGMLQuantizationType

from bench.lab.kquants import quantize_any
from bench.lab.step_profile import read_bandwidth
from engine.checkpoint_quant import fp8_blocks
from kernels.gguf_blocks import INT8_KINDS, BlockKind, BlockMatrix
from kernels.kmix import cat_rows
from kernels.native_ops import NativeOps, native_ops

FORMATS = ("float32", "bf16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "Q4_K_M", "fp8")
PRODUCTS = ("qkv", "o", "gate_up", "down")


def shapes(hidden: int, heads: int, kv_heads: int, head_dim: int,
           intermediate: int) -> dict[str, list[tuple[int, int]]]:
    """Each product's parts as ``(out, in)``, in row order (QKV: Q, K, V; gate/up: gate, up)."""
    q, kv = heads * head_dim, kv_heads * head_dim
    return {"qkv": [(q, hidden), (kv, hidden), (kv, hidden)], "o": [(hidden, q)],
            "gate_up": [(intermediate, hidden), (intermediate, hidden)], "down": [(hidden, intermediate)]}


def part_type(fmt: str, product: str, index: int) -> GGMLQuantizationType:
    """The GGUF type of one part of a product in a block format."""
    if fmt != "Q4_K_M":
        return GGMLQuantizationType[fmt]
    more = (product == "qkv" and index == 2) or product == "down"
    return GGMLQuantizationType.Q6_K if more else GGMLQuantizationType.Q4_K


class Product:
    """One product held in one format: ``run(x, int8)`` multiplies, ``nbytes`` is what it holds."""

    def __init__(self, ops: NativeOps, fmt: str, product: str, parts: list[torch.Tensor]) -> None:
        self.ops, self.out_features = ops, sum(p.shape[0] for p in parts)
        self.kind: BlockKind | None = None
        if fmt == "fp8":
            blocks = [fp8_block_scaled(part) for part in parts]
            joined = cat_rows(blocks)
            assert joined is not None
            self.kind, self.packed, self.bf16 = joined.kind, ops.qpack(joined), False
        elif fmt in ("float32", "bf16"):
            weight = torch.cat(parts)
            self.packed = ops.pack(weight) if fmt == "float32" else ops.pack_bf16(weight)
            self.bf16 = fmt == "bf16"
        else:
            blocks = []
            for i, part in enumerate(parts):
                qtype = part_type(fmt, product, i)
                raw = quantize_any(part.numpy(), qtype)
                blocks.append(BlockMatrix(BlockKind[qtype.name], torch.from_numpy(np.ascontiguousarray(raw)),
                                          part.shape[1]))
            joined = cat_rows(blocks)
            assert joined is not None
            self.kind, self.packed, self.bf16 = joined.kind, ops.qpack(joined), False
        self.nbytes = self.packed.numel() * self.packed.element_size()

    def run(self, x: torch.Tensor, int8: bool) -> torch.Tensor:
        if self.kind is not None:
            return self.ops.qpacked_linear(x, self.packed, self.kind, self.out_features, None, int8)
        if self.bf16:
            return self.ops.bf16_linear(x, self.packed, self.out_features, None)
        return self.ops.packed_linear(x, self.packed, self.out_features, None)


def fp8_block_scaled(weight: torch.Tensor, block: int = 128) -> BlockMatrix:
    """``weight`` as e4m3 codes over ``block`` x ``block`` scales (amax / 448), as the loader keeps them."""
    rows, cols = -(-weight.shape[0] // block), -(-weight.shape[1] // block)
    padded = torch.zeros(rows * block, cols * block)
    padded[:weight.shape[0], :weight.shape[1]] = weight
    amax = padded.reshape(rows, block, cols, block).abs().amax(dim=(1, 3)).clamp(min=1e-12)
    scale = amax / 448.0
    full = scale.repeat_interleave(block, 0).repeat_interleave(block, 1)[:weight.shape[0], :weight.shape[1]]
    kept = fp8_blocks((weight / full).to(torch.float8_e4m3fn), scale, (block, block))
    assert kept is not None
    return kept


def layer_call(products: list[Product], xs: list[torch.Tensor], int8: bool) -> Callable[[], None]:
    def call() -> None:
        for product, x in zip(products, xs, strict=True):
            product.run(x, int8)
    return call


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,16")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--shape", default="2048,32,8,64,8192",
                        help="HIDDEN,HEADS,KV_HEADS,HEAD_DIM,INTERMEDIATE")
    parser.add_argument("--formats", default=",".join(FORMATS))
    parser.add_argument("--bw-bytes", type=int, default=1 << 30)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = parser.parse_args()
    ops = native_ops()
    if ops is None:
        raise SystemExit("the native kernel library cannot be built here")
    torch.set_num_threads(args.threads)
    hidden, heads, kv_heads, head_dim, intermediate = (int(v) for v in args.shape.split(","))
    layer = shapes(hidden, heads, kv_heads, head_dim, intermediate)
    gen = torch.Generator().manual_seed(0)
    weights = {name: [torch.randn(out, inp, generator=gen) * 0.02 for out, inp in parts]
               for name, parts in layer.items()}
    formats = args.formats.split(",")
    held = {fmt: [Product(ops, fmt, name, weights[name]) for name in PRODUCTS] for fmt in formats}
    bandwidth = read_bandwidth(args.bw_bytes)
    rows_list = [int(r) for r in args.rows.split(",")]
    results = []
    for rows in rows_list:
        xs = [torch.randn(rows, layer[name][0][1], generator=gen) for name in PRODUCTS]
        calls: dict[tuple[str, bool], Callable[[], None]] = {}
        for fmt in formats:
            calls[(fmt, False)] = layer_call(held[fmt], xs, False)
            if held[fmt][0].kind in INT8_KINDS and ops.int8_available:
                calls[(fmt, True)] = layer_call(held[fmt], xs, True)
        for call in calls.values():
            call()
        best = dict.fromkeys(calls, float("inf"))
        for _ in range(args.repeats):
            for key, call in calls.items():
                start = time.perf_counter()
                call()
                best[key] = min(best[key], time.perf_counter() - start)
        for fmt in formats:
            nbytes = sum(p.nbytes for p in held[fmt])
            int8 = best.get((fmt, True))
            results.append({"format": fmt, "rows": rows, "mb": nbytes / 1e6,
                            "float_ms": best[(fmt, False)] * 1e3,
                            "int8_ms": None if int8 is None else int8 * 1e3,
                            "floor_ms": nbytes / bandwidth * 1e3})
    if args.json:
        print(json.dumps({"threads": args.threads, "shape": args.shape, "read_bandwidth_gbs": bandwidth / 1e9,
                          "results": results}))
        return
    print(f"threads {args.threads}; shape {args.shape}; read bandwidth {bandwidth / 1e9:.1f} GB/s")
    print(f"{'format':8} {'rows':>4} {'MB':>7} {'float32 act ms':>14} {'int8 act ms':>11} {'floor ms':>8}")
    for r in results:
        int8_ms = "-" if r["int8_ms"] is None else f"{r['int8_ms']:.2f}"
        print(f"{r['format']:8} {r['rows']:>4} {r['mb']:>7.1f} {r['float_ms']:>14.2f} {int8_ms:>11} "
              f"{r['floor_ms']:>8.2f}")


if __name__ == "__main__":
    main()

"""Ahead-of-time compiles of the Triton kernels for NVIDIA targets, with no GPU.

``triton.compile(ASTSource(...), target=GPUTarget("cuda", arch, 32))`` lowers a kernel
to PTX and runs the wheel's ``ptxas`` to a cubin; the wheel's ``cuobjdump
--dump-resource-usage`` then reports registers and stack. A configuration fails when
it does not compile (e.g. a 16-bit ``tl.dot`` with K < 16, an fp8 type the arch lacks),
when it spills (``STACK`` or ``LOCAL`` > 0), or when its shared memory (the pipelined dot
operands) exceeds what one block may use on the arch.

Each configuration compiles twice: ``generic`` (no hints: what the JIT builds when a pointer
or stride is not a multiple of 16) and ``aligned`` (every pointer 16-byte aligned and every
stride and model dimension a multiple of 16: what the JIT builds for real models' shapes,
where loads vectorize and 16-bit dots pipeline through ``cp.async``). Their register use
differs widely (the generic build often needs twice the registers), so both must hold.

Run ``python -m kernels.triton_aot`` (without ``TRITON_INTERPRET``) to compile every
configuration ``all_launches`` enumerates for sm_80 and sm_90; the unit test compiles
a covering subset, since each compile takes seconds.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from typing import Any

import torch

from kernels.triton_configs import (
    MODEL_DTYPES,
    KernelLaunch,
    block_linear_launch_configs,
    launch_configs,
    mla_launch_configs,
    moe_launch_configs,
    supported_dtype_pairs,
)

ARCHS = (80, 90)
SHARED_LIMIT = {80: 166912, 90: 232448}  # bytes of shared memory one block may opt in to (A100, H100)
ALIGNED_INTS = ("block_size", "n_cols", "k_dim", "hidden")  # with every ``stride_*``: multiples of 16
HEAD_DIMS = (64, 128)  # the Triton backend refuses head dims above MAX_HEAD_DIM
BLOCK_SIZES = (16, 32)


@dataclass
class CompileResult:
    kernel: str
    arch: int
    constexprs: dict[str, Any]
    aligned: bool = False
    registers: int = -1
    stack: int = -1
    local: int = -1
    shared: int = -1
    error: str = ""

    @property
    def ok(self) -> bool:
        return (not self.error and self.stack == 0 and self.local == 0
                and 0 <= self.shared <= SHARED_LIMIT.get(self.arch, SHARED_LIMIT[80]))


def all_launches() -> list[KernelLaunch]:
    """Every distinct configuration the attention backend, the MoE kernels, the latent decode kernel and
    the product over kept blocks (``kernels/triton_blocks.py``) can launch for the supported dtypes and
    shapes."""
    configs: list[KernelLaunch] = []
    for model_dtype, kv_dtype in supported_dtype_pairs():
        for head_dim in HEAD_DIMS:
            for block_size in BLOCK_SIZES:
                configs += launch_configs(model_dtype, kv_dtype, head_dim, block_size)
    for model_dtype in MODEL_DTYPES:
        configs += (moe_launch_configs(model_dtype) + mla_launch_configs(model_dtype)
                    + block_linear_launch_configs(model_dtype))
    seen: dict[str, KernelLaunch] = {}
    for cfg in configs:
        key = [cfg.module, cfg.kernel, cfg.constexprs, cfg.signature, cfg.num_warps]
        seen.setdefault(json.dumps(key, sort_keys=True), cfg)
    return list(seen.values())


def _cuobjdump() -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def alignment_hints(signature: dict[str, str]) -> dict[tuple[int, ...], list[list[Any]]]:
    """The ``aligned`` build's hints: pointers, strides and ``ALIGNED_INTS`` divisible by 16."""
    return {(i,): [["tt.divisibility", 16]] for i, (name, ty) in enumerate(signature.items())
            if ty.startswith("*") or name.startswith("stride") or name in ALIGNED_INTS}


def compile_kernel(fn: Any, signature: dict[str, str], constexprs: dict[str, Any], arch: int,
                   num_warps: int, aligned: bool = False) -> CompileResult:
    """Compile one jitted function (not an interpreted one) for ``sm_<arch>``; never raises."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    result = CompileResult(fn.__name__, arch, dict(constexprs), aligned)
    source = ASTSource(fn, signature, constexprs, alignment_hints(signature) if aligned else None)
    try:
        compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32),
                                  options={"num_warps": num_warps})
    except Exception as exc:  # a compile error is the result we report
        result.error = f"{type(exc).__name__}: {exc}"[:2000]
        return result
    result.shared = int(compiled.metadata.shared)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        usage = subprocess.run([_cuobjdump(), "--dump-resource-usage", f.name], capture_output=True,
                               text=True, check=True).stdout
    for field in ("REG", "STACK", "LOCAL"):
        match = re.search(rf"\b{field}:(\d+)", usage)
        if match is None:
            result.error = f"no {field} in cuobjdump output: {usage[:500]}"
            return result
        setattr(result, {"REG": "registers", "STACK": "stack", "LOCAL": "local"}[field], int(match.group(1)))
    return result


def compile_launch(cfg: KernelLaunch, arch: int, aligned: bool = False) -> CompileResult:
    module = importlib.import_module(cfg.module)
    return compile_kernel(getattr(module, cfg.kernel), cfg.signature, cfg.constexprs, arch, cfg.num_warps,
                          aligned)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="compile every Triton kernel configuration for NVIDIA")
    parser.add_argument("--arch", type=int, action="append", help="compute capability x 10 (default: 80, 90)")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        parser.error("unset TRITON_INTERPRET: interpreted kernels cannot be compiled")
    failed = 0
    for cfg in all_launches():
        for arch in args.arch or ARCHS:
            for aligned in (False, True):
                result = compile_launch(cfg, arch, aligned)
                failed += not result.ok
                print(json.dumps({**asdict(result), "ok": result.ok}), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    torch.set_num_threads(1)
    sys.exit(main())

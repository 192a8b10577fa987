"""Ahead-of-time compiles of the Triton kernels for NVIDIA targets, with no GPU.

``triton.compile(ASTSource(...), target=GPUTarget("cuda", arch, 32))`` lowers a kernel
to PTX and runs the wheel's ``ptxas`` to a cubin; the wheel's ``cuobjdump
--dump-resource-usage`` then reports registers and stack. A configuration fails when
it does not compile (e.g. a 16-bit ``tl.dot`` with K < 16, an fp8 type the arch lacks)
or when it spills (``STACK`` or ``LOCAL`` > 0).

Run ``python -m kernels.triton_aot`` (without ``TRITON_INTERPRET``) to compile every
configuration ``all_launches`` enumerates for sm_80 and sm_90; the unit test compiles
a covering subset, since each compile takes seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from typing import Any

import torch

from kernels.triton_configs import KernelLaunch, launch_configs, supported_dtype_pairs

ARCHS = (80, 90)
HEAD_DIMS = (64, 128)  # the Triton backend refuses head dims above MAX_HEAD_DIM
BLOCK_SIZES = (16, 32)


@dataclass
class CompileResult:
    kernel: str
    arch: int
    constexprs: dict[str, Any]
    registers: int = -1
    stack: int = -1
    local: int = -1
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error and self.stack == 0 and self.local == 0


def all_launches() -> list[KernelLaunch]:
    """Every distinct configuration the backend can launch for the supported dtypes and shapes."""
    seen: dict[str, KernelLaunch] = {}
    for model_dtype, kv_dtype in supported_dtype_pairs():
        for head_dim in HEAD_DIMS:
            for block_size in BLOCK_SIZES:
                for cfg in launch_configs(model_dtype, kv_dtype, head_dim, block_size):
                    key = [cfg.kernel, cfg.constexprs, cfg.signature, cfg.num_warps]
                    seen.setdefault(json.dumps(key, sort_keys=True), cfg)
    return list(seen.values())


def _cuobjdump() -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def compile_kernel(fn: Any, signature: dict[str, str], constexprs: dict[str, Any], arch: int,
                   num_warps: int) -> CompileResult:
    """Compile one jitted function (not an interpreted one) for ``sm_<arch>``; never raises."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    result = CompileResult(fn.__name__, arch, dict(constexprs))
    try:
        compiled = triton.compile(ASTSource(fn, signature, constexprs), target=GPUTarget("cuda", arch, 32),
                                  options={"num_warps": num_warps})
    except Exception as exc:  # a compile error is the result we report
        result.error = f"{type(exc).__name__}: {exc}"[:2000]
        return result
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


def compile_launch(cfg: KernelLaunch, arch: int) -> CompileResult:
    from kernels import triton_attention

    return compile_kernel(getattr(triton_attention, cfg.kernel), cfg.signature, cfg.constexprs, arch,
                          cfg.num_warps)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="compile every Triton kernel configuration for NVIDIA")
    parser.add_argument("--arch", type=int, action="append", help="compute capability x 10 (default: 80, 90)")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        parser.error("unset TRITON_INTERPRET: interpreted kernels cannot be compiled")
    failed = 0
    for cfg in all_launches():
        for arch in args.arch or ARCHS:
            result = compile_launch(cfg, arch)
            failed += not result.ok
            print(json.dumps({**asdict(result), "ok": result.ok}), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    torch.set_num_threads(1)
    sys.exit(main())

"""Run by ``test_triton_aot.py`` in a child process without ``TRITON_INTERPRET``: compiles the
configurations it is given (or all) for NVIDIA targets and two kernels known to be faulty.

Prints one JSON object per compile: ``{"name": ..., "ok": ..., "registers": ..., "error": ...}``.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict

import torch
import triton
import triton.language as tl

from kernels.gguf_blocks import BlockKind
from kernels.moe import ACTIVATIONS
from kernels.triton_aot import CompileResult, all_launches, compile_kernel, compile_launch
from kernels.triton_configs import (
    attention_launch,
    block_linear_launch,
    mla_launch,
    moe_launch,
    moe_sum_launch,
    write_launch,
)


@triton.jit
def small_dot_kernel(a_ptr, b_ptr, c_ptr, K: tl.constexpr):
    """``[16, K] @ [K, 16]`` in bfloat16: NVIDIA rejects K < 16."""
    i = tl.arange(0, 16)
    k = tl.arange(0, K)
    a = tl.load(a_ptr + i[:, None] * K + k[None, :])
    b = tl.load(b_ptr + k[:, None] * 16 + i[None, :])
    tl.store(c_ptr + i[:, None] * 16 + i[None, :], tl.dot(a, b))


@triton.jit
def fp8_cast_kernel(x_ptr, y_ptr):
    """A float32 -> e4m3 cast through Triton's fp8 type: sm_80 has none."""
    i = tl.arange(0, 16)
    tl.store(y_ptr + i, tl.load(x_ptr + i).to(tl.float8e4nv))


def covering() -> list[tuple[str, CompileResult]]:
    """Every kernel, every KV kind, both dot paths, the attention features, the MoE products, the
    product over kept blocks and the latent decode kernel at the largest head dim and tile sizes, on
    sm_80 and sm_90: generic builds (no alignment hints, the most registers) and a few aligned ones
    (pipelined, as real shapes compile), including the configurations nearest the register limit."""
    bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32
    e4m3, e5m2, int8 = torch.float8_e4m3fn, torch.float8_e5m2, torch.int8
    swiglu, gelu = ACTIVATIONS.index("swiglu_oai"), ACTIVATIONS.index("gelu_tanh")
    many = 1 << 20  # tokens: the large MoE tiles
    out: list[tuple[str, CompileResult]] = []
    for arch in (80, 90):
        prefill = attention_launch(bf16, e4m3, 128, False)
        out.append((f"prefill bf16/e4m3 sm_{arch}", compile_launch(prefill, arch)))
        out.append((f"write bf16/e4m3 sm_{arch}", compile_launch(write_launch(bf16, e4m3, 128, 16), arch)))
        decode = attention_launch(bf16, bf16, 128, True, sinks=True, softcap=True)
        out.append((f"decode bf16 sinks softcap sm_{arch}", compile_launch(decode, arch)))
        int4 = torch.uint8  # kernels/kv_int4.py's bytes
        int4_prefill = attention_launch(bf16, int4, 128, False)
        out.append((f"prefill bf16/int4 sm_{arch}", compile_launch(int4_prefill, arch)))
        out.append((f"write bf16/int4 sm_{arch}", compile_launch(write_launch(bf16, int4, 128, 16), arch)))
        gate_up = moe_launch(bf16, many, 8, True, swiglu, True)
        out.append((f"moe gate/up bf16 swiglu bias sm_{arch}", compile_launch(gate_up, arch)))
    out.append(("prefill fp32 sm_90", compile_launch(attention_launch(fp32, fp32, 128, False), 90)))
    out.append(("decode fp16/int8 sm_90", compile_launch(attention_launch(fp16, int8, 128, True), 90)))
    out.append(("write fp16/e5m2 bs32 sm_90", compile_launch(write_launch(fp16, e5m2, 128, 32), 90)))
    out.append(("write bf16 sm_80", compile_launch(write_launch(bf16, bf16, 128, 16), 80)))
    out.append(("decode fp16 hd64 sm_80", compile_launch(attention_launch(fp16, fp16, 64, True), 80)))
    out.append(("decode fp16/e5m2 softcap sm_80",
                compile_launch(attention_launch(fp16, e5m2, 128, True, softcap=True), 80)))
    features = attention_launch(bf16, e4m3, 128, False, sinks=True, softcap=True)
    out.append(("prefill bf16/e4m3 sinks softcap sm_90 aligned", compile_launch(features, 90, aligned=True)))
    out.append(("moe gate/up bf16 swiglu bias sm_90 aligned", compile_launch(gate_up, 90, aligned=True)))
    out.append(("moe gate/up bf16 small sm_90", compile_launch(moe_launch(bf16, 1, 8, True, 0, False), 90)))
    out.append(("moe gate/up fp32 gelu sm_80",
                compile_launch(moe_launch(fp32, many, 8, True, gelu, False), 80)))
    out.append(("moe down fp16 bias sm_80 aligned",
                compile_launch(moe_launch(fp16, many, 8, False, 0, True), 80, aligned=True)))
    out.append(("moe sum bf16 sm_80", compile_launch(moe_sum_launch(bf16), 80)))
    # the latent decode kernel at DeepSeek's 512 + 64: the plain 16-bit build, the quantized ones
    # nearest the register limit (255 and 8 warps), and float32's
    out.append(("mla decode bf16 sm_80", compile_launch(mla_launch(bf16, bf16, 512, 64), 80)))
    mla = mla_launch(bf16, bf16, 512, 64)
    out.append(("mla decode bf16 sm_90 aligned", compile_launch(mla, 90, aligned=True)))
    out.append(("mla decode bf16/e4m3 sm_90", compile_launch(mla_launch(bf16, e4m3, 512, 64), 90)))
    out.append(("mla decode fp16/int8 sm_80", compile_launch(mla_launch(fp16, int8, 512, 64), 80)))
    out.append(("mla decode fp32 sm_90", compile_launch(mla_launch(fp32, fp32, 512, 64), 90)))
    # the product over kept blocks: the kinds with the most decoding (Q5_1's fifth bits and minimum, FP8,
    # KMIX's two halves and minimum) at the prompt tile, the most registers, generic and aligned
    q5_1, fp8, kmix = BlockKind.Q5_1, BlockKind.FP8, BlockKind.KMIX
    for name, launch, arch, aligned in (
            ("blocks Q5_1 bf16 prompt sm_90", block_linear_launch(bf16, q5_1, many, True), 90, False),
            ("blocks FP8 bf16 prompt sm_80 aligned", block_linear_launch(bf16, fp8, many, False), 80, True),
            ("blocks Q5_1 fp32 prompt sm_80", block_linear_launch(fp32, q5_1, many, True), 80, False),
            ("blocks FP8 fp16 decode sm_90", block_linear_launch(fp16, fp8, 1, True), 90, False),
            ("blocks KMIX bf16 prompt sm_80", block_linear_launch(bf16, kmix, many, True), 80, False)):
        out.append((name, compile_launch(launch, arch, aligned)))
    return out


def known_faults() -> list[tuple[str, CompileResult]]:
    dot_sig = {"a_ptr": "*bf16", "b_ptr": "*bf16", "c_ptr": "*fp32", "K": "constexpr"}
    cast_sig = {"x_ptr": "*fp32", "y_ptr": "*fp8e4nv"}
    return [
        ("fault: bf16 dot K=8 sm_90", compile_kernel(small_dot_kernel, dot_sig, {"K": 8}, 90, 4)),
        ("control: bf16 dot K=16 sm_90", compile_kernel(small_dot_kernel, dot_sig, {"K": 16}, 90, 4)),
        ("fault: e4m3 cast sm_80", compile_kernel(fp8_cast_kernel, cast_sig, {}, 80, 4)),
        ("control: e4m3 cast sm_90", compile_kernel(fp8_cast_kernel, cast_sig, {}, 90, 4)),
    ]


def main() -> None:
    mode = sys.argv[1]
    if mode == "all":
        results = [(f"{i} {c.kernel} sm_{a}{' aligned' if al else ''}", compile_launch(c, a, al))
                   for i, c in enumerate(all_launches()) for a in (80, 90) for al in (False, True)]
    else:
        results = known_faults() if mode == "faults" else covering()
    for name, result in results:
        print(json.dumps({"name": name, "ok": result.ok, **asdict(result)}), flush=True)


if __name__ == "__main__":
    main()

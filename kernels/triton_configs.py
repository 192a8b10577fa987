"""Every Triton kernel configuration pdserve launches, from one place.

``launch_configs`` is what ``kernels/triton_backend.py`` looks its launches up in,
``moe_launch`` / ``moe_sum_launch`` what ``kernels/triton_moe.py`` does and ``mla_launch`` what
``kernels/mla_backends.py`` does; the ahead-of-time
compile test walks both (``tests/unit/test_triton_aot.py``), so a configuration that does
not compile (or spills registers) for sm_80 / sm_90 is found on a CPU-only machine before
any GPU sees it.

Tile sizes: ``BLOCK_N`` (keys per step) stays >= 16 because NVIDIA's MMA needs
K >= 16 for 16-bit operands (the ``p @ v`` dot has K = ``BLOCK_N``); keys are gathered
through the block table per column, so the page size never sets a dot shape.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from kernels import kv_int4
from kernels.gguf_blocks import BLOCK_BYTES, BlockKind
from kernels.moe import ACTIVATIONS


def interpreting() -> bool:
    """Whether Triton kernels run under its interpreter (``TRITON_INTERPRET=1``: on CPU, the tests)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


ATTENTION = "paged_attention_kernel"
WRITE = "write_kv_kernel"
WRITE_QUANTIZED = "write_kv_quantized_kernel"
WRITE_INT4 = "write_kv_int4_kernel"
MLA_DECODE = "mla_decode_kernel"
MOE_GEMM = "moe_gemm_kernel"
MOE_SUM = "moe_sum_kernel"
ATTENTION_MODULE = "kernels.triton_attention"
MOE_MODULE = "kernels.triton_moe"
MLA_MODULE = "kernels.triton_mla"
INT4_MODULE = "kernels.triton_int4"


def attention_tiles(model_dtype: torch.dtype, head_dim: int, decode: bool, fp8_softcap: bool = False,
                    int4: bool = False) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps), chosen so that no launch spills on sm_80 or sm_90 (the AOT
    check found each exception): float32 dots run on FMA units and need 8 warps at head_dim 128
    with a quantized cache; 16-bit decode at BLOCK_N 16 and 16-bit prefill at head_dim 64 with
    BLOCK_M 32 put a few bytes on the stack; 4 warps spill 16-bit prefill at head_dim 128.
    ``fp8_softcap`` (an fp8 cache's decoding plus the cap's tanh): 16-bit decode spills 8 bytes
    on sm_80 at (16, 32, 4) and 16 on sm_90 at (16, 32, 8); (16, 16, 8) fits every build. ``int4`` (a
    nibble and a group's range per key and channel): 16-bit tiles of (16, 32, 4) spill up to 360 bytes at
    head_dim 128 and 8 at 64 (with softcap, sm_80); (16, 16, 8) fits, and prefill at head_dim 128 keeps
    (32, 16, 8)."""
    if model_dtype == torch.float32:
        return (16, 16, 8)
    if (decode and fp8_softcap) or (int4 and (decode or head_dim <= 64)):
        return (16, 16, 8)
    if decode or head_dim <= 64:
        return (16, 32, 4)
    return (32, 16, 8)


MAX_HEAD_DIM = 128  # larger head dims spill at these tiles (kernels/triton_aot.py checks)

MODEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
QUANTIZED_KV = (torch.float8_e4m3fn, torch.float8_e5m2, torch.int8, torch.uint8)  # uint8: int4's bytes

_TRITON_TYPES = {
    torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16",
    torch.int8: "i8", torch.uint8: "u8",
}


@dataclass(frozen=True)
class KvFormat:
    """How the kernels see a cache dtype: ``kind`` (see ``kernels/triton_codes.py``), fp8 bits, range."""

    kind: int
    mant: int = 0
    bias: int = 0
    qmax: float = 0.0

    @property
    def quantized(self) -> bool:
        return self.kind != 0


def kv_format(kv_dtype: torch.dtype) -> KvFormat:
    if kv_dtype == torch.uint8:  # int4 (kernels/kv_int4.py)
        return KvFormat(3, qmax=15.0)
    if kv_dtype == torch.int8:
        return KvFormat(1, qmax=127.0)
    if kv_dtype == torch.float8_e4m3fn:
        return KvFormat(2, 3, 7, float(torch.finfo(kv_dtype).max))
    if kv_dtype == torch.float8_e5m2:
        return KvFormat(2, 2, 15, float(torch.finfo(kv_dtype).max))
    if kv_dtype in MODEL_DTYPES:
        return KvFormat(0)
    raise ValueError(f"the Triton backend does not support a {kv_dtype} KV cache")


def storage_dtype(kv_dtype: torch.dtype) -> torch.dtype:
    """The dtype the kernels take the cache as (fp8 is passed as its bytes)."""
    return torch.uint8 if kv_dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else kv_dtype


def block_d(head_dim: int) -> int:
    return max(16, 1 << (head_dim - 1).bit_length())


@dataclass(frozen=True)
class KernelLaunch:
    """One compiled variant: kernel name, its constexprs, the argument types for AOT compiles, and the
    module that defines the kernel."""

    kernel: str
    constexprs: dict[str, int | float | bool] = field(hash=False)
    signature: dict[str, str] = field(hash=False)
    num_warps: int = 4
    module: str = ATTENTION_MODULE


def _ptrs(names: str, ty: str) -> dict[str, str]:
    return {n: f"*{ty}" for n in names.split()}


def _ints(names: str) -> dict[str, str]:
    return {n: "i32" for n in names.split()}


def attention_launch(model_dtype: torch.dtype, kv_dtype: torch.dtype, head_dim: int, decode: bool,
                     interpret: bool = False, sinks: bool = False, softcap: bool = False) -> KernelLaunch:
    """The attention kernel's launch; ``sinks``/``softcap``: the layer has them (the window is a
    runtime argument, so one build serves windowed and full layers)."""
    fmt = kv_format(kv_dtype)
    m, kv = _TRITON_TYPES[model_dtype], _TRITON_TYPES[storage_dtype(kv_dtype)]
    fp8_softcap = softcap and fmt.kind == 2  # KIND_FP8
    block_m, block_n, num_warps = attention_tiles(model_dtype, head_dim, decode, fp8_softcap, fmt.kind == 3)
    constexprs: dict[str, int | float | bool] = dict(
        HEAD_DIM=head_dim, BLOCK_D=block_d(head_dim), BLOCK_M=block_m, BLOCK_N=block_n,
        KV_KIND=fmt.kind, MANT=fmt.mant, BIAS=fmt.bias, DOT_FP32=interpret or model_dtype == torch.float32,
        HAS_SINKS=sinks, SOFTCAP=softcap, GROUP=kv_int4.group_size(head_dim),
    )
    signature = {
        **_ptrs("q_ptr k_ptr v_ptr", m), **_ptrs("kv_ptr", kv), **_ptrs("scales_ptr", "fp32"),
        **_ptrs("out_ptr", m), **_ptrs("sinks_ptr", "fp32"),
        **_ptrs("tables_ptr qstart_ptr seqlen_ptr tile_seq_ptr tile_row_ptr", "i32"),
        **{n: "fp32" for n in ("sm_scale_log2", "cap_in", "cap_out_log2")},
        **_ints("window q_per_kv block_size"),
        **_ints("stride_qt stride_qh stride_kt stride_kh stride_vt stride_vh stride_ot stride_oh stride_tab"),
        **_ints("stride_kvb stride_kvs stride_kvt stride_kvh stride_sb stride_ss"),
        **{k: "constexpr" for k in constexprs},
    }
    return KernelLaunch(ATTENTION, constexprs, signature, num_warps)


def write_launch(model_dtype: torch.dtype, kv_dtype: torch.dtype, head_dim: int,
                 block_size: int) -> KernelLaunch:
    fmt = kv_format(kv_dtype)
    m, kv = _TRITON_TYPES[model_dtype], _TRITON_TYPES[storage_dtype(kv_dtype)]
    strides = _ints("stride_kt stride_kh stride_vt stride_vh stride_kvb stride_kvs stride_kvt stride_kvh")
    if not fmt.quantized:
        constexprs: dict[str, int | float | bool] = dict(HEAD_DIM=head_dim, BLOCK_D=block_d(head_dim))
        signature = {**_ptrs("k_ptr v_ptr", m), **_ptrs("kv_ptr", kv), **_ptrs("slot_ptr", "i64"),
                     "block_size": "i32", **strides, **{k: "constexpr" for k in constexprs}}
        return KernelLaunch(WRITE, constexprs, signature)
    if fmt.kind == 3:  # int4: kernels/triton_int4.py
        constexprs = dict(HEAD_DIM=head_dim, BLOCK_J=block_d(head_dim) // 2, PAGE=block_size,
                          BLOCK_T=1 << (block_size - 1).bit_length(), GROUP=kv_int4.group_size(head_dim))
        signature = {**_ptrs("k_ptr v_ptr", m), **_ptrs("kv_ptr", kv), **_ptrs("params_ptr", "fp32"),
                     **_ptrs("blk_ptr start_ptr end_ptr tok_ptr", "i32"), **strides,
                     **_ints("stride_pb stride_ps"), **{k: "constexpr" for k in constexprs}}
        # 4 warps spill 8 bytes at head_dim 64 and 32-row pages on sm_80 (the AOT check); 8 fit every build
        return KernelLaunch(WRITE_INT4, constexprs, signature, num_warps=8, module=INT4_MODULE)
    constexprs = dict(HEAD_DIM=head_dim, BLOCK_D=block_d(head_dim), PAGE=block_size,
                      BLOCK_T=1 << (block_size - 1).bit_length(), QMAX=fmt.qmax,
                      KV_KIND=fmt.kind, MANT=fmt.mant, BIAS=fmt.bias)
    signature = {**_ptrs("k_ptr v_ptr", m), **_ptrs("kv_ptr", kv), **_ptrs("scales_ptr", "fp32"),
                 **_ptrs("blk_ptr start_ptr end_ptr tok_ptr", "i32"), **strides,
                 **_ints("stride_sb stride_ss"), **{k: "constexpr" for k in constexprs}}
    return KernelLaunch(WRITE_QUANTIZED, constexprs, signature)


def supported_dtype_pairs() -> list[tuple[torch.dtype, torch.dtype]]:
    """(model dtype, KV cache dtype) pairs the backend runs: plain caches in the model dtype,
    quantized caches under any model dtype."""
    pairs = [(d, d) for d in MODEL_DTYPES]
    return pairs + [(m, q) for m in MODEL_DTYPES for q in QUANTIZED_KV]


def launch_configs(model_dtype: torch.dtype, kv_dtype: torch.dtype, head_dim: int,
                   block_size: int) -> list[KernelLaunch]:
    """Everything one model's steps can launch: the KV write, decode tiles and prefill tiles, each
    with and without sinks and softcap."""
    return [write_launch(model_dtype, kv_dtype, head_dim, block_size)] + [
        attention_launch(model_dtype, kv_dtype, head_dim, decode, sinks=sinks, softcap=softcap)
        for decode in (True, False) for sinks in (False, True) for softcap in (False, True)
    ]


def moe_tiles(model_dtype: torch.dtype, small: bool, gated: bool) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps) of one expert product. ``small``: no more
    tokens than experts, so most experts see a few pairs and a 16-row block wastes least; else
    64-row blocks grouped by 8 for L2 reuse of the weight tiles. Both products share BLOCK_M (one
    alignment serves both). The gated product keeps two accumulators, so its tile is half as wide;
    float32 dots run on FMA units (``input_precision="ieee"``), so their tiles are smaller and the
    gated one takes 8 warps. Each choice is the widest that compiles without spilling on sm_80 and
    sm_90, with and without 16-byte alignment (``kernels/triton_aot.py``)."""
    if model_dtype == torch.float32:
        if small:
            return (16, 32, 32, 1, 4)
        return (32, 64, 16, 8, 8 if gated else 4)
    if small:
        return (16, 32 if gated else 64, 32, 1, 4)
    return (64, 32 if gated else 64, 32, 8, 4)


def moe_launch(model_dtype: torch.dtype, tokens: int, experts: int, gated: bool, activation: int,
               has_bias: bool, interpret: bool = False) -> KernelLaunch:
    """``moe_gemm_kernel``'s launch: the gate/up product with ``activation`` (``MoeActivation.code``)
    when ``gated``, else the down product with the routing weight."""
    block_m, block_n, block_k, group_m, num_warps = moe_tiles(model_dtype, tokens <= experts, gated)
    constexprs: dict[str, int | float | bool] = dict(
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=group_m, GATED=gated,
        ACTIVATION=activation if gated else 0, HAS_BIAS=has_bias,
        DOT_FP32=interpret or model_dtype == torch.float32,
    )
    m = _TRITON_TYPES[model_dtype]
    signature = {
        **_ptrs("a_ptr w_ptr b_ptr", m), **_ptrs("weights_ptr", "fp32"), **_ptrs("out_ptr", m),
        **_ptrs("pairs_ptr block_expert_ptr padded_ptr", "i32"),
        **_ints("num_pairs row_div num_blocks_m n_cols k_dim"), "alpha": "fp32", "limit": "fp32",
        **_ints("stride_at stride_we stride_wn stride_be stride_ot"),
        **{k: "constexpr" for k in constexprs},
    }
    return KernelLaunch(MOE_GEMM, constexprs, signature, num_warps, MOE_MODULE)


def moe_sum_launch(model_dtype: torch.dtype) -> KernelLaunch:
    constexprs: dict[str, int | float | bool] = dict(BLOCK_T=16, BLOCK_H=256)
    m = _TRITON_TYPES[model_dtype]
    signature = {**_ptrs("y_ptr", m), **_ptrs("ids_ptr", "i64"), **_ptrs("out_ptr", m),
                 **_ints("tokens hidden top_k stride_yt stride_ot"), **{k: "constexpr" for k in constexprs}}
    return KernelLaunch(MOE_SUM, constexprs, signature, 4, MOE_MODULE)


def moe_launch_configs(model_dtype: torch.dtype) -> list[KernelLaunch]:
    """Everything a MoE layer in ``model_dtype`` can launch: both products at both tile sizes, every
    activation, with and without biases, and the sum over ``k``."""
    out = [moe_sum_launch(model_dtype)]
    for tokens in (1, 1 << 20):  # small and large tiles
        for has_bias in (False, True):
            out.append(moe_launch(model_dtype, tokens, 8, False, 0, has_bias))
            out += [moe_launch(model_dtype, tokens, 8, True, act, has_bias)
                    for act in range(len(ACTIVATIONS))]
    return out


MLA_SHAPES = ((512, 64),)  # (kv_lora_rank, qk_rope_head_dim): every DeepSeek-V2/V3 config's


def mla_tiles(model_dtype: torch.dtype, quantized: bool) -> tuple[int, int, int]:
    """(BLOCK_H, BLOCK_N, num_warps) of the latent decode kernel. ``BLOCK_H`` 16 is the smallest MMA
    M; the accumulator is ``BLOCK_H x 512`` float32, so 16 keys a step. Chosen with the AOT check
    (``kernels/triton_aot.py``): no build spills on sm_80 or sm_90. Dequantizing a tile of codes
    takes registers of its own: 4 warps spill 16-bit quantized builds on sm_90 (8 do not). A float32
    model over a quantized latent spills 2 KB of stack at 8 and 16 warps alike, so it has no build:
    ``mla_supported`` says no and the backend takes the torch reference's form for it."""
    if model_dtype == torch.float32:
        return (16, 16, 8)
    return (16, 16, 8 if quantized else 4)


def mla_supported(model_dtype: torch.dtype, kv_dtype: torch.dtype) -> bool:
    """Whether ``mla_decode_kernel`` has a build for this pair (see ``mla_tiles``)."""
    quantized = kv_format(kv_dtype).quantized
    if kv_dtype == torch.uint8:  # int4 stores no latent cache (engine/kv_tensors.py refuses it)
        return False
    return model_dtype in MODEL_DTYPES and not (model_dtype == torch.float32 and quantized)


def mla_launch(model_dtype: torch.dtype, kv_dtype: torch.dtype, rank: int, rope: int,
               interpret: bool = False) -> KernelLaunch:
    """``mla_decode_kernel``'s launch for a latent of ``rank`` + ``rope`` values per token; the
    queries are in ``model_dtype`` (float32 when interpreting), the output float32."""
    fmt = kv_format(kv_dtype)
    block_h, block_n, num_warps = mla_tiles(model_dtype, fmt.quantized)
    constexprs: dict[str, int | float | bool] = dict(
        RANK=rank, ROPE=rope, BLOCK_R=block_d(rank), BLOCK_P=block_d(rope), BLOCK_H=block_h,
        BLOCK_N=block_n, KV_KIND=fmt.kind, MANT=fmt.mant, BIAS=fmt.bias,
        DOT_FP32=interpret or model_dtype == torch.float32,
    )
    q = "fp32" if interpret else _TRITON_TYPES[model_dtype]
    signature = {
        **_ptrs("q_ptr", q), **_ptrs("out_ptr", "fp32"),
        **_ptrs("cache_ptr", _TRITON_TYPES[storage_dtype(kv_dtype)]),
        **_ptrs("scales_ptr", "fp32"), **_ptrs("tables_ptr lens_ptr", "i32"), "sm_scale_log2": "fp32",
        **_ints("heads block_size stride_qs stride_qh stride_os stride_oh stride_tab stride_row"),
        **{k: "constexpr" for k in constexprs},
    }
    return KernelLaunch(MLA_DECODE, constexprs, signature, num_warps, MLA_MODULE)


def mla_launch_configs(model_dtype: torch.dtype) -> list[KernelLaunch]:
    """Everything a latent cache under ``model_dtype`` can launch: a plain cache in the model dtype
    and every quantized one it has a build for, at every DeepSeek latent shape."""
    kv_dtypes = [kv for kv in (model_dtype, *QUANTIZED_KV) if mla_supported(model_dtype, kv)]
    return [mla_launch(model_dtype, kv, rank, rope) for rank, rope in MLA_SHAPES for kv in kv_dtypes]


BLOCK_LINEAR = "block_linear_kernel"
DECODE_ROWS = 16  # the block product's rows up to which it takes the decode tile
BLOCK_LINEAR_MODULE = "kernels.triton_blocks"
# the records the block product decodes: every kind kept (GGUF's 32-input kinds, its K formats' 256-input
# super-blocks, KMIX and FP8)
TRITON_KINDS = (BlockKind.Q4_0, BlockKind.Q4_1, BlockKind.Q5_0, BlockKind.Q5_1, BlockKind.Q8_0, BlockKind.FP8,
                BlockKind.Q4_K, BlockKind.Q5_K, BlockKind.Q6_K, BlockKind.KMIX)


def block_linear_tiles(model_dtype: torch.dtype, rows: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) of the product over kept records (``kernels/triton_blocks.py``):
    16 rows (the smallest MMA M) for a decode step's few tokens, 64 for prompt chunks; each record's
    codes are decoded once per 16 or 64 rows. float32 dots run on FMA units, so their tiles are smaller.
    Each is the widest that compiles without spilling on sm_80 and sm_90 for every kind
    (``kernels/triton_aot.py``): float32's 16 x 64 spilled 8-16 bytes at 4 and at 8 warps and its 32 x 64
    at 8 (a bias, FP8, Q5, KMIX); its 16 x 32 at 4 warps and 32 x 32 at 8 take at most 175 registers."""
    if model_dtype == torch.float32:
        return (16, 32, 4) if rows <= DECODE_ROWS else (32, 32, 8)
    return (16, 64, 4) if rows <= DECODE_ROWS else (64, 64, 8)


def block_linear_launch(model_dtype: torch.dtype, kind: int, rows: int, has_bias: bool,
                        interpret: bool = False) -> KernelLaunch:
    """``block_linear_kernel``'s launch for ``rows`` activation rows in ``model_dtype`` over records of
    ``kind`` (a ``kernels.gguf_blocks.BlockKind`` value)."""
    block_m, block_n, num_warps = block_linear_tiles(model_dtype, rows)
    if interpret:  # Triton's interpreter runs each program in Python: wide tiles, few programs
        block_n = 128
    constexprs: dict[str, int | float | bool] = dict(
        KIND=int(kind), REC=BLOCK_BYTES[BlockKind(kind)], HAS_BIAS=has_bias, BLOCK_M=block_m,
        BLOCK_N=block_n, DOT_FP32=interpret or model_dtype == torch.float32,
    )
    m = _TRITON_TYPES[model_dtype]
    signature = {
        **_ptrs("x_ptr", m), **_ptrs("w_ptr", "u8"), **_ptrs("b_ptr y_ptr", m),
        **_ints("M N K stride_xm stride_ym row_bytes"), **{k: "constexpr" for k in constexprs},
    }
    return KernelLaunch(BLOCK_LINEAR, constexprs, signature, num_warps, BLOCK_LINEAR_MODULE)


def block_linear_launch_configs(model_dtype: torch.dtype) -> list[KernelLaunch]:
    """Every launch of the block product in ``model_dtype``: each record kind (``TRITON_KINDS``), both
    tiles, with and without a bias."""
    return [block_linear_launch(model_dtype, kind, rows, bias)
            for kind in TRITON_KINDS for rows in (1, 1 << 20) for bias in (False, True)]

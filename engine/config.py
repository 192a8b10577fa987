"""Frozen configuration for the engine, and the model's (``engine/model_config.py``, re-exported here).

``EngineConfig`` holds the knobs a user sets (block size, KV budget, scheduler limits, precisions); values
derived from it and the model's ``ModelConfig`` live in properties so nothing is stored twice.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from engine.model_config import (
    FULL_ATTENTION,
    HIDDEN_ACTS,
    LAYER_TYPES,
    MOE_ACTIVATIONS,
    MOE_ROUTERS,
    SLIDING_ATTENTION,
    SUPPORTED_ARCHITECTURES,
    MlaConfig,
    ModelConfig,
    MoeConfig,
    RopeScaling,
)
from engine.spec_config import SpeculativeConfig
from kernels.kv_quant import is_quantized, parse_kv_cache_dtype
from kernels.linear import LINEAR_KERNELS
from kernels.triton_configs import interpreting

__all__ = ["ATTENTION_BACKENDS", "FULL_ATTENTION", "GGUF_ACTIVATIONS", "HIDDEN_ACTS", "KV_EVICTION_POLICIES",
           "LAYER_TYPES", "MOE_ACTIVATIONS", "MOE_ROUTERS", "QUANTIZATION_METHODS", "SLIDING_ATTENTION",
           "SUPPORTED_ARCHITECTURES", "EngineConfig", "MlaConfig", "ModelConfig", "MoeConfig", "RopeScaling",
           "parse_dtype"]

ATTENTION_BACKENDS = ("auto", "triton", "flashinfer", "torch")
# the quantized Hugging Face checkpoints read (``quant_method``; engine/checkpoint_quant.py)
QUANTIZATION_METHODS = ("fp8", "mxfp4")
# the activations of the products over GGUF blocks (EngineConfig.gguf_activations, --gguf-activations)
GGUF_ACTIVATIONS = ("float32", "int8")
# what frees a sequence's KV blocks by attention (EngineConfig.kv_eviction, --kv-eviction;
# engine/kv_eviction.py)
KV_EVICTION_POLICIES = ("none", "h2o", "headwise")

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """Map a user-facing dtype name to a torch dtype, with a clear error."""
    if isinstance(name, torch.dtype):
        return name
    try:
        return _DTYPES[name.lower()]
    except KeyError:
        choices = ", ".join(sorted(set(_DTYPES)))
        raise ValueError(f"unsupported dtype {name!r}; choose one of: {choices}") from None


@dataclass(frozen=True)
class EngineConfig:
    """Engine knobs. ``None`` means "derive it" (see the properties / engine)."""

    dtype: str = "auto"  # bfloat16 on CUDA, float32 elsewhere (see torch_dtype)
    # the products over GGUF blocks kept under dtype auto (keeps_gguf_blocks): float32 activations (the
    # dequantized float32 model's values, bitwise) or int8 ones (llama.cpp's arithmetic, AVX512-VNNI;
    # kernels/cpu_qint8.c); GGUF_ACTIVATIONS
    gguf_activations: str = "float32"
    # what the checkpoint's quantization_config must say (None: whatever it says, or nothing)
    quantization: str | None = None
    device: str = "cpu"
    block_size: int = 16
    kv_cache_memory: int = 512 * 1024**2
    gpu_memory_utilization: float = 0.9
    num_kv_blocks: int | None = None
    enable_prefix_caching: bool = True
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    max_model_len: int | None = None
    seed: int = 0
    kv_cache_dtype: str = "auto"
    preemption_mode: str = "recompute"
    swap_space: int = 1024**3
    kv_offload_bytes: int = 0
    kv_offload_dir: str | None = None
    kv_offload_disk_bytes: int = 8 * 1024**3
    kv_sinks: int = 0
    kv_window: int | None = None
    # attention-aware eviction (engine/kv_eviction.py): "none", "h2o" or "headwise" (KV_EVICTION_POLICIES),
    # each sequence's KV budget in tokens and the recent tokens it always keeps (default: half the budget)
    kv_eviction: str = "none"
    kv_budget: int | None = None
    kv_recent: int | None = None
    # a hybrid model's sliding-window layers keep only the blocks their window reads, in KV groups of
    # their own (engine/kv_groups.py); off: every layer keeps every block (their attention is the same)
    hybrid_kv: bool = True
    # native CPU kernels (kernels/cpu_native.py): off runs torch ops, MKL's packed products and the torch
    # attention; native_decoder every layer of a step in one native call; greedy_head greedy rows' tokens
    # from a half-precision screen of the LM head (kernels/greedy_head.py); large_product the product of
    # prompt chunks under linear_kernel "prepacked" (auto: by CPU vendor; kernels/linear.py)
    native_kernels: bool = True
    native_decoder: bool = True
    greedy_head: bool = True
    large_product: str = "auto"
    # in-flight prefix dedup (engine/scheduler.py): a waiting request waits for at least this many
    # of its next prompt tokens that a running request is computing; 0 turns it off
    prefix_wait_min_tokens: int = 128
    # paged attention kernels: auto (flashinfer, else triton on CUDA; the native/torch kernels on CPU),
    # or one of ATTENTION_BACKENDS by name
    attention_backend: str = "auto"
    # decode step speed (engine/model_runner.py, kernels/linear.py): the linear kernel ("native": the
    # native one-row GEMV and oneDNN above, no extra weight copy; "prepacked" packs weights at load for
    # MKL / oneDNN on CPU fp32; "plain" is torch's F.linear); compile_cpu compiles
    # the decoder layers with inductor for decode batches padded to buckets; enforce_eager turns off
    # both compilation and CUDA graphs (engine/graph_runner.py); num_threads sets torch's intra-op
    # threads when the engine starts (None leaves them as they are)
    linear_kernel: str = "native"
    enforce_eager: bool = False
    # pure-decode steps through the CUDA-graph path's padded static buffers with no capture, on any
    # device (engine/graph_runner.py): how CPU tests check that path (it runs the steps it takes instead
    # of compile_cpu); on CUDA without enforce_eager the path is on anyway, captured
    pad_decode_steps: bool = False
    compile_cpu: bool = False
    num_threads: int | None = None
    # speculative decoding (engine/spec_config.py), vLLM's dict: {"method": "ngram", ...}; None: off
    speculative_config: dict[str, Any] | None = None
    # tensor parallelism (engine/tensor_parallel.py): ranks (devices) one engine spans, vLLM's name; every
    # collective of the group waits at most tp_timeout_s (a dead or hung rank is an error, not a hang)
    tensor_parallel_size: int = 1
    tp_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if self.speculative_config is not None:
            SpeculativeConfig.from_dict(self.speculative_config)
        if self.dtype.lower() != "auto":
            parse_dtype(self.dtype)
        self._check_gguf_activations()
        self._check_bf16_products()
        if self.attention_backend not in ATTENTION_BACKENDS:
            choices = ", ".join(ATTENTION_BACKENDS)
            raise ValueError(f"attention_backend must be one of {choices}, got {self.attention_backend!r}")
        parse_kv_cache_dtype(self.kv_cache_dtype)
        if self.quantization is not None and self.quantization not in QUANTIZATION_METHODS:
            raise ValueError(f"--quantization must be one of {', '.join(QUANTIZATION_METHODS)}, got "
                             f"{self.quantization!r}")
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"--preemption-mode must be recompute or swap, got {self.preemption_mode!r}")
        if self.swap_space < 0:
            raise ValueError(f"--swap-space must be >= 0, got {self.swap_space}")
        if self.kv_offload_bytes < 0 or self.kv_offload_disk_bytes < 0:
            raise ValueError("--kv-offload-bytes and --kv-offload-disk-bytes must be >= 0")
        if self.kv_window is not None and self.kv_window < 1:
            raise ValueError(f"--kv-window must be at least 1, got {self.kv_window}")
        self._check_eviction()
        if self.kv_sinks < 0 or (self.kv_sinks and self.kv_window is None):
            raise ValueError("--kv-sinks must be >= 0 and needs --kv-window")
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"--block-size must be a positive power of two, got {self.block_size}")
        if self.kv_cache_memory <= 0:
            raise ValueError(f"--kv-cache-memory must be positive, got {self.kv_cache_memory}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"--num-kv-blocks must be at least 1, got {self.num_kv_blocks}")
        if self.max_num_batched_tokens < 1:
            raise ValueError("--max-num-batched-tokens must be at least 1")
        if self.max_num_seqs < 1:
            raise ValueError("--max-num-seqs must be at least 1")
        if self.prefix_wait_min_tokens < 0:
            raise ValueError(f"prefix_wait_min_tokens must be >= 0, got {self.prefix_wait_min_tokens}")
        if self.large_product not in ("auto", "mkl", "onednn"):
            raise ValueError(f"--large-product must be auto, mkl or onednn, got {self.large_product!r}")
        if self.linear_kernel not in LINEAR_KERNELS:
            raise ValueError(f"linear_kernel must be one of {LINEAR_KERNELS}, got {self.linear_kernel!r}")
        if self.linear_kernel == "triton" and torch.device(self.device).type != "cuda" and not interpreting():
            raise ValueError(f"--linear-kernel triton runs Triton kernels, which need a CUDA device (or "
                             f"TRITON_INTERPRET=1), got --device {self.device}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be at least 1, got {self.num_threads}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError("--max-model-len must be at least 1")
        self._check_tensor_parallel()

    def _check_bf16_products(self) -> None:
        if self.bf16_products and self.compile_enabled:
            raise ValueError(f"--dtype {self.dtype} on CPU runs the native bfloat16 product, which the "
                             f"compiled path (--compile-cpu) does not: drop --compile-cpu")

    def _check_gguf_activations(self) -> None:
        """int8 activations apply to the blocks kept on CPU by the native product only: refused, naming the
        flag in the way, anywhere else (the CPU's own support is checked when the model is built)."""
        if self.gguf_activations not in GGUF_ACTIVATIONS:
            raise ValueError(f"--gguf-activations must be one of {', '.join(GGUF_ACTIVATIONS)}, got "
                             f"{self.gguf_activations!r}")
        if self.gguf_activations == "float32":
            return
        if self.dtype.lower() != "auto":
            raise ValueError(f"--gguf-activations {self.gguf_activations} applies to GGUF weights kept in "
                             f"their blocks, and --dtype {self.dtype} dequantizes them: use --dtype auto, or "
                             f"--gguf-activations float32")
        off = {"--device cpu": torch.device(self.device).type != "cpu",
               "--native-kernels": not self.native_kernels,
               "--linear-kernel native": self.linear_kernel != "native",
               "--no-compile-cpu": self.compile_enabled}
        missing = [flag for flag, lacking in off.items() if lacking]
        if missing:
            raise ValueError(f"--gguf-activations {self.gguf_activations} runs in the native product over "
                             f"GGUF blocks on CPU; it needs {', '.join(missing)}")

    def _check_tensor_parallel(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError(f"--tensor-parallel-size must be at least 1, got {self.tensor_parallel_size}")
        if self.tp_timeout_s <= 0:
            raise ValueError(f"tp_timeout_s must be positive, got {self.tp_timeout_s}")
        if self.tensor_parallel_size == 1:
            return
        offload = bool(self.kv_offload_bytes or self.kv_offload_dir)
        unsupported = {"--preemption-mode swap": self.preemption_mode == "swap",
                       "--kv-offload-bytes / --kv-offload-dir": offload, "compile_cpu": self.compile_cpu}
        named = [flag for flag, on in unsupported.items() if on]
        if named:
            raise ValueError(f"--tensor-parallel-size {self.tensor_parallel_size} does not combine with "
                             f"{', '.join(named)} yet")

    @property
    def keeps_gguf_blocks(self) -> bool:
        """Whether a GGUF's Q4, Q5, Q6_K and Q8_0 matrices (and fp8 codes) stay in their blocks (``--dtype
        auto``, the default; the products are bitwise those of the float32 weights,
        ``kernels/cpu_qpacked.c``). An explicit ``--dtype`` dequantizes them."""
        return self.dtype.lower() == "auto"

    @property
    def bf16_products(self) -> bool:
        """``--dtype bfloat16`` on CPU with the native product: the model's weights stored in bfloat16, its
        products in bfloat16 with float32 sums (``kernels/cpu_bf16.c``), the activations between them,
        norms, attention and the KV cache in float32 (``torch_dtype``). Without the native product
        (``--no-native-kernels``, another ``--linear-kernel``) the model runs in torch's bfloat16."""
        return (self.dtype.lower() != "auto" and parse_dtype(self.dtype) == torch.bfloat16
                and torch.device(self.device).type == "cpu" and self.native_kernels
                and self.linear_kernel == "native")

    def resolve_auto(self, model: ModelConfig, cpu_runs_bf16: bool,
                     kept_codes: bool = False) -> tuple[EngineConfig, str]:
        """``--dtype auto`` for this model: on CPU a checkpoint that names bfloat16 takes the native
        bfloat16 products (``bf16_products``) where the CPU runs them natively (``cpu_runs_bf16``:
        AVX512-BF16) and nothing else asks for float32 (the native product, no ``--compile-cpu``, float32
        GGUF activations, an fp8 or MXFP4 checkpoint whose codes the float32 products keep:
        ``kept_codes``); anything else is as given. Returns the config and why, in words ("" when
        unchanged)."""
        if (not cpu_runs_bf16 or self.dtype.lower() != "auto" or torch.device(self.device).type != "cpu"
                or self.compile_enabled or self.gguf_activations != "float32" or kept_codes
                or model.checkpoint_dtype not in ("bfloat16", "bf16")):
            return self, ""
        candidate = dataclasses.replace(self, dtype="bfloat16")
        if not candidate.bf16_products:  # no native product
            return self, ""
        return candidate, ("--dtype auto: the checkpoint is bfloat16 and this CPU multiplies bfloat16 "
                           "natively (AVX512-BF16), so the products run in bfloat16")

    @property
    def torch_dtype(self) -> torch.dtype:
        """The model's activations' dtype; ``auto`` is bfloat16 on CUDA and float32 elsewhere; float32
        under ``bf16_products``."""
        if self.dtype.lower() == "auto":
            return torch.bfloat16 if torch.device(self.device).type == "cuda" else torch.float32
        return torch.float32 if self.bf16_products else parse_dtype(self.dtype)

    def _check_eviction(self) -> None:
        """``--kv-eviction`` and its budget: ValueError naming the flag."""
        if self.kv_eviction not in KV_EVICTION_POLICIES:
            raise ValueError(f"--kv-eviction must be one of {', '.join(KV_EVICTION_POLICIES)}, "
                             f"got {self.kv_eviction!r}")
        if self.kv_eviction == "none":
            if self.kv_budget is not None or self.kv_recent is not None:
                raise ValueError("--kv-budget and --kv-recent need --kv-eviction h2o or headwise")
            return
        if self.kv_budget is None:
            raise ValueError(f"--kv-eviction {self.kv_eviction} needs --kv-budget TOKENS")
        recent = self.kv_recent_tokens
        if recent < 1 or self.kv_budget < recent + 2 * self.block_size:
            raise ValueError(f"--kv-budget ({self.kv_budget}) must exceed --kv-recent ({recent}) by at least "
                             f"two blocks ({2 * self.block_size} tokens), and --kv-recent must be at least 1")
        for flag, on in (("--kv-window", self.kv_window is not None),
                         ("--speculative-config", self.speculative_config is not None)):
            if on:
                raise ValueError(f"--kv-eviction {self.kv_eviction} does not combine with {flag}")

    @property
    def kv_compression(self) -> str:
        """What frees a running sequence's blocks, as both sides of a KV transfer must agree (a sequence
        handed over keeps being compressed the same way): ``""`` (nothing), ``"window=W,sinks=S"``
        (``--kv-window``) or ``"<policy>,budget=B,recent=R"`` (``--kv-eviction h2o`` or ``headwise``)."""
        if self.kv_window is not None:
            return f"window={self.kv_window},sinks={self.kv_sinks}"
        if self.kv_eviction != "none":
            return f"{self.kv_eviction},budget={self.kv_budget},recent={self.kv_recent_tokens}"
        return ""

    @property
    def kv_recent_tokens(self) -> int:
        """``--kv-recent``, or half of ``--kv-budget`` (H2O's even split of heavy and recent tokens)."""
        if self.kv_recent is not None:
            return self.kv_recent
        return (self.kv_budget or 0) // 2

    @property
    def kv_torch_dtype(self) -> torch.dtype:
        """Storage dtype of the KV cache: the model dtype for ``auto``, else fp8/int8."""
        return parse_kv_cache_dtype(self.kv_cache_dtype) or self.torch_dtype

    @property
    def compile_enabled(self) -> bool:
        """Whether the CPU decode path runs compiled (``compile_cpu`` and not ``enforce_eager``)."""
        return self.compile_cpu and not self.enforce_eager and self.device == "cpu"

    @property
    def speculative(self) -> SpeculativeConfig | None:
        """The parsed ``speculative_config`` (None when speculation is off)."""
        if self.speculative_config is None:
            return None
        return SpeculativeConfig.from_dict(self.speculative_config)

    @property
    def kv_quantized(self) -> bool:
        return is_quantized(self.kv_torch_dtype)

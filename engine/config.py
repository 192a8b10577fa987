"""Frozen configuration for the model and the engine.

``ModelConfig`` describes a decoder-only transformer of one of the registered families
(``engine/models/``) independently of where its weights come from; each family's module builds it
from a Hugging Face ``config.json`` or from GGUF metadata. The fields say what a layer computes
(attention kinds per layer, q/k norms, sinks, softcaps, rope variants, a mixture of experts), never
which family asked for it, so the layers and the KV sizing read them without knowing the family.
``EngineConfig`` holds the knobs a user sets (block size, KV budget, scheduler limits); values derived
from both live in properties so nothing is stored twice.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.spec_config import SpeculativeConfig
from kernels.kv_quant import is_quantized, parse_kv_cache_dtype
from kernels.linear import LINEAR_KERNELS

# the model families (``ModelConfig.architecture``); ``engine/models/`` registers one module for each
SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral", "gemma3", "gpt_oss",
                           "deepseek_v2", "deepseek_v3")
FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
LAYER_TYPES = (FULL_ATTENTION, SLIDING_ATTENTION)
HIDDEN_ACTS = ("silu", "gelu_tanh")
MOE_ROUTERS = ("softmax_topk", "topk_softmax", "softmax_group_topk", "sigmoid_group_topk")
MOE_ACTIVATIONS = ("silu", "swiglu_oai")
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
class RopeScaling:
    """Rope frequency scaling. ``rope_type`` is ``default``, ``linear``, ``llama3`` or ``yarn``
    (``beta_fast`` .. ``truncate``: YaRN's, as transformers reads them)."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True


@dataclass(frozen=True)
class MoeConfig:
    """A mixture-of-experts MLP: ``num_experts`` experts of ``intermediate_size``, ``top_k`` per token.

    ``router``: ``softmax_topk`` (softmax over every expert's logit, then the top k, renormalised to
    sum 1 when ``renormalize``: Mixtral, Qwen3-MoE), ``topk_softmax`` (the top k logits, then a softmax
    over those: gpt-oss), ``softmax_group_topk`` (DeepSeek-V2's group-limited greedy: the experts of the
    ``topk_group`` of ``n_group`` groups with the highest expert probability) or ``sigmoid_group_topk``
    (DeepSeek-V3: sigmoid scores; the choice adds the router's ``correction_bias`` and keeps the groups
    whose best two sum highest; the weights are the plain scores); DeepSeek's weights are then multiplied
    by ``routed_scaling_factor``. ``router_bias``: the router has a bias; ``expert_bias``: each expert's
    products have biases. ``activation``: ``silu`` (SiLU(gate) * up) or ``swiglu_oai`` (gpt-oss's
    clamped SwiGLU with ``swiglu_alpha`` and ``swiglu_limit``). ``shared_intermediate_size``: a dense
    SiLU MLP of that size beside the experts, its output added (DeepSeek's shared experts; 0: none).
    ``dense_layers``: layers that keep a dense MLP of the model's ``intermediate_size`` instead.
    """

    num_experts: int
    top_k: int
    intermediate_size: int
    router: str = "softmax_topk"
    renormalize: bool = True
    router_bias: bool = False
    expert_bias: bool = False
    activation: str = "silu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    dense_layers: tuple[int, ...] = ()
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    correction_bias: bool = False
    shared_intermediate_size: int = 0

    def __post_init__(self) -> None:
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"bad model config: num_experts_per_tok ({self.top_k}) must be in "
                             f"[1, num_experts ({self.num_experts})]")
        if self.intermediate_size <= 0:
            raise ValueError(f"bad model config: the experts' intermediate size must be positive, "
                             f"got {self.intermediate_size}")
        if self.router not in MOE_ROUTERS:
            raise ValueError(f"unknown MoE router {self.router!r}; known: {', '.join(MOE_ROUTERS)}")
        if self.num_experts % self.n_group or not 0 < self.topk_group <= self.n_group:
            raise ValueError(f"bad model config: {self.num_experts} experts in n_group {self.n_group} "
                             f"groups, topk_group {self.topk_group} of them")
        if self.activation not in MOE_ACTIVATIONS:
            raise ValueError(f"unknown MoE activation {self.activation!r}; "
                             f"known: {', '.join(MOE_ACTIVATIONS)}")


@dataclass(frozen=True)
class MlaConfig:
    """Multi-head latent attention (DeepSeek-V2/V3): each token caches one latent of ``kv_lora_rank``
    values (RMSNormed) and one rotary key of ``qk_rope_head_dim`` shared by every head; each head's keys
    (``qk_nope_head_dim`` of them beside the rotary ones) and values (``v_head_dim``) are the latent's
    up-projection. Queries come from the hidden state directly, or through a LoRA of ``q_lora_rank``.
    ``rope_interleave``: rope rotates adjacent pairs of the rotary dims (DeepSeek's layout)."""

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None
    rope_interleave: bool = True

    @property
    def latent_dim(self) -> int:
        """Values cached per token per layer: the latent and the rotary key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    sliding_window: int | None = None
    name: str = "model"
    # per layer FULL_ATTENTION or SLIDING_ATTENTION (``sliding_window`` tokens); () means every layer
    # is full attention
    layer_types: tuple[str, ...] = ()
    qk_norm: bool = False  # an RMSNorm over each query and key head before rope (Qwen3, Gemma 3)
    attention_sinks: bool = False  # one learned softmax logit per query head (gpt-oss)
    o_proj_bias: bool = False
    attention_scale: float | None = None  # the softmax scale; None: head_dim ** -0.5
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    # the rope base of sliding layers, which then take no rope scaling (Gemma 3); None: as full layers
    local_rope_theta: float | None = None
    hidden_act: str = "silu"  # the dense MLP's gate activation: silu or gelu_tanh
    moe: MoeConfig | None = None
    # latent attention (DeepSeek): then head_dim is the query/key head (nope + rope), num_kv_heads 1
    mla: MlaConfig | None = None
    # the dtype a Hugging Face checkpoint's config.json names (``dtype`` or ``torch_dtype``); None: a GGUF
    checkpoint_dtype: str | None = None

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ValueError(f"bad model config: {name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"bad model config: num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if self.layer_types:
            if len(self.layer_types) != self.num_layers:
                raise ValueError(f"bad model config: {len(self.layer_types)} layer_types for "
                                 f"{self.num_layers} layers")
            unknown = sorted(set(self.layer_types) - set(LAYER_TYPES))
            if unknown:
                raise ValueError(f"bad model config: unknown layer type {unknown[0]!r}; known: "
                                 f"{', '.join(LAYER_TYPES)}")
            if SLIDING_ATTENTION in self.layer_types and not (self.sliding_window or 0) > 0:
                raise ValueError("bad model config: sliding_attention layers need a positive sliding_window")
        if self.hidden_act not in HIDDEN_ACTS:
            raise ValueError(f"unsupported hidden activation {self.hidden_act!r}; supported: "
                             f"{', '.join(HIDDEN_ACTS)}")

    @property
    def q_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    def layer_window(self, layer: int) -> int | None:
        """The attention window of ``layer`` in tokens (None: full attention)."""
        if self.layer_types and self.layer_types[layer] == SLIDING_ATTENTION:
            return self.sliding_window
        return None

    @property
    def has_sliding_layers(self) -> bool:
        return SLIDING_ATTENTION in self.layer_types

    def is_moe_layer(self, layer: int) -> bool:
        """Whether ``layer``'s MLP is the mixture of experts (else the dense MLP)."""
        return self.moe is not None and layer not in self.moe.dense_layers

    @property
    def kv_parts(self) -> int:
        """Tensors cached per token and layer: K and V, or MLA's one latent."""
        return 1 if self.mla is not None else 2

    @property
    def kv_head_dim(self) -> int:
        """Width of one cached head: ``head_dim``, or MLA's latent and rotary key together."""
        return self.mla.latent_dim if self.mla is not None else self.head_dim

    def kv_bytes_per_token(self, element_bytes: int) -> int:
        """2 (K and V; 1 latent for MLA) x layers x KV heads x KV head dim x bytes per element."""
        return self.kv_parts * self.num_layers * self.num_kv_heads * self.kv_head_dim * element_bytes


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
               "--tensor-parallel-size 1": self.tensor_parallel_size != 1,
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

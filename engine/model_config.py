"""``ModelConfig``: a decoder-only transformer of one of the registered families, independent of where its
weights come from.

Each family's module (``engine/models/``) builds it from a Hugging Face ``config.json`` or from GGUF
metadata. The fields say what a layer computes (attention kinds per layer, q/k norms, sinks, softcaps,
rope variants, a mixture of experts as ``MoeConfig``, latent attention as ``MlaConfig``), never which family
asked for it, so the layers and the KV sizing read them without knowing the family. Values derived from
the fields live in properties so nothing is stored twice.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# the model families (``ModelConfig.architecture``); ``engine/models/`` registers one module for each
SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral", "gemma3", "gpt_oss",
                           "deepseek_v2", "deepseek_v3")
FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
LAYER_TYPES = (FULL_ATTENTION, SLIDING_ATTENTION)
HIDDEN_ACTS = ("silu", "gelu_tanh")
MOE_ROUTERS = ("softmax_topk", "topk_softmax", "softmax_group_topk", "sigmoid_group_topk")
MOE_ACTIVATIONS = ("silu", "swiglu_oai")


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

"""Megatron-style sharding of a decoder over ``size`` ranks: which slice each rank holds.

Pure arithmetic over ``ModelConfig``; no torch.distributed here (``engine/tp_group.py`` moves tensors).

Per rank ``r`` of ``size``:

- attention: query heads ``[r*H/size, (r+1)*H/size)`` (``H`` must divide by ``size``); KV heads
  ``[r*K/size, (r+1)*K/size)`` when ``size <= K`` (``K`` must divide by ``size``), else one KV head,
  ``r*K // size``, replicated on ``size/K`` ranks (``size`` must be a multiple of ``K``), as vLLM does.
  Either way a rank's query heads all read KV heads it holds. The fused QKV (and Qwen2's qkv bias) is
  column-parallel (rows of those heads), ``o_proj`` row-parallel (its columns), summed by an all-reduce;
- MLP: ``gate_up`` column-parallel (``I/size`` rows of gate and of up), ``down_proj`` row-parallel;
  a mixture of experts splits every expert the same way (``I`` its ``moe.intermediate_size``; no
  expert parallelism: every rank holds a slice of every expert), the router replicated;
- the row-parallel biases (``o_proj``, the experts' ``down_proj``) and the q/k norms are whole on every
  rank (the layers add a row-parallel bias on rank 0 only); attention sinks follow the query heads;
- vocabulary: rows ``[r*V', min((r+1)*V', V))`` of the embedding and the LM head with
  ``V' = ceil(V/size)``; every rank allocates ``V'`` rows (the last one's tail stays zero). The
  embedding is a masked lookup summed by an all-reduce; the logits are gathered to rank 0 and cut to
  ``V``. Tied embeddings share the one shard.

``weight_slice(name)`` says which part of a Hugging Face tensor a rank reads, so loaders read only
that (``safetensors`` slices, GGUF rows before dequantization): the layer library's names and the
checkpoint names the families map onto them (Mixtral's ``w1``/``w3``/``w2``, gpt-oss's fused
``experts.gate_up_proj`` ``[E, hidden, 2I]`` with gate and up interleaved, so a contiguous column slice
holds both halves of the rank's features, and ``experts.down_proj`` ``[E, I, hidden]``).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

import torch

from engine.config import ModelConfig

_LAYER_NAME = re.compile(
    r"model\.layers\.\d+\.(self_attn|mlp|block_sparse_moe)\.(experts\.\d+\.)?(\w+)\.(weight|bias)")
_SHARED_EXPERTS = re.compile(r"model\.layers\.\d+\.mlp\.shared_experts\.(\w+)\.weight")
_FUSED_EXPERTS = re.compile(r"model\.layers\.\d+\.mlp\.experts\.(gate_up_proj|gate_up_proj_bias|down_proj)")
_SINKS = re.compile(r"model\.layers\.\d+\.self_attn\.sinks")
_COLUMN_PARALLEL = ("gate_proj", "up_proj", "w1", "w3")  # a dense MLP's or an expert's
_ROW_PARALLEL = ("down_proj", "w2")


@dataclass(frozen=True)
class WeightSlice:
    """``[start, stop)`` along dimension ``dim`` (0: rows / output features, 1: columns / inputs)."""

    dim: int
    start: int
    stop: int

    def take(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.narrow(self.dim, self.start, self.stop - self.start)


@dataclass(frozen=True)
class TpShard:
    """What rank ``rank`` of ``size`` holds of ``config`` (see the module docstring)."""

    config: ModelConfig
    rank: int = 0
    size: int = 1

    def __post_init__(self) -> None:
        check_tp_size(self.config, self.size)
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} outside a tensor-parallel group of {self.size}")

    @property
    def num_heads(self) -> int:
        return self.config.num_heads // self.size

    @property
    def num_kv_heads(self) -> int:
        return max(self.config.num_kv_heads // self.size, 1)

    @property
    def head_range(self) -> tuple[int, int]:
        return self.rank * self.num_heads, (self.rank + 1) * self.num_heads

    @property
    def kv_head_range(self) -> tuple[int, int]:
        """The KV heads this rank holds (one replicated head when ``size`` exceeds the KV heads)."""
        start = self.rank * self.config.num_kv_heads // self.size
        return start, start + self.num_kv_heads

    @property
    def intermediate_size(self) -> int:
        return self.config.intermediate_size // self.size

    @property
    def expert_intermediate_size(self) -> int:
        """This rank's columns of each expert's intermediate size (0 without experts)."""
        moe = self.config.moe
        return 0 if moe is None else moe.intermediate_size // self.size

    @property
    def vocab_per_rank(self) -> int:
        return -(-self.config.vocab_size // self.size)

    @property
    def vocab_range(self) -> tuple[int, int]:
        start = min(self.rank * self.vocab_per_rank, self.config.vocab_size)
        return start, min(start + self.vocab_per_rank, self.config.vocab_size)

    @property
    def kv_config(self) -> ModelConfig:
        """``config`` with this rank's KV heads: what ``engine.kv_sizing`` sizes a rank's blocks by."""
        return dataclasses.replace(self.config, num_kv_heads=self.num_kv_heads)

    def weight_slice(self, name: str) -> WeightSlice | None:
        """The part of Hugging Face parameter ``name`` this rank holds; None: all of it (norms, routers)."""
        hd = self.config.head_dim
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            return WeightSlice(0, *self.vocab_range)
        q0, q1 = self.head_range
        if _SINKS.fullmatch(name):
            return WeightSlice(0, q0, q1)
        shared = _SHARED_EXPERTS.fullmatch(name)
        if shared is not None and self.config.moe is not None:  # DeepSeek's shared experts: a dense MLP
            inter = self.config.moe.shared_intermediate_size // self.size
            cut = (self.rank * inter, (self.rank + 1) * inter)
            return WeightSlice(1 if shared.group(1) == "down_proj" else 0, *cut)
        fused = _FUSED_EXPERTS.fullmatch(name)
        if fused is not None:  # gpt-oss's stacked experts, input-major
            inter, r = self.expert_intermediate_size, self.rank
            if fused.group(1) == "down_proj":
                return WeightSlice(1, r * inter, (r + 1) * inter)
            dim = 1 if fused.group(1).endswith("bias") else 2  # [E, 2I] or [E, hidden, 2I]
            return WeightSlice(dim, 2 * r * inter, 2 * (r + 1) * inter)
        match = _LAYER_NAME.fullmatch(name)
        if match is None:
            return None
        part, kind = match.group(3), match.group(4)
        k0, k1 = self.kv_head_range
        inter = self.expert_intermediate_size if match.group(2) else self.intermediate_size
        mla = self.config.mla
        if mla is not None:  # latent attention: the query heads' rows; the latent's products whole
            if part in ("q_proj", "q_b_proj"):
                return WeightSlice(0, q0 * hd, q1 * hd)
            if part == "kv_b_proj":
                per_head = mla.qk_nope_head_dim + mla.v_head_dim
                return WeightSlice(0, q0 * per_head, q1 * per_head)
            if part in ("k_b_proj", "v_b_proj"):  # GGUF's halves of kv_b_proj, [heads, ., .]
                return WeightSlice(0, q0, q1)
            if part == "o_proj" and kind == "weight":
                return WeightSlice(1, q0 * mla.v_head_dim, q1 * mla.v_head_dim)
            if part in ("q_a_proj", "kv_a_proj_with_mqa"):
                return None
        if part == "q_proj":
            return WeightSlice(0, q0 * hd, q1 * hd)
        if part in ("k_proj", "v_proj"):
            return WeightSlice(0, k0 * hd, k1 * hd)
        if part == "o_proj" and kind == "weight":
            return WeightSlice(1, q0 * hd, q1 * hd)
        if part in _COLUMN_PARALLEL:
            return WeightSlice(0, self.rank * inter, (self.rank + 1) * inter)
        if part in _ROW_PARALLEL and kind == "weight":
            return WeightSlice(1, self.rank * inter, (self.rank + 1) * inter)
        return None


def check_tp_size(config: ModelConfig, size: int) -> None:
    """Raise ``ValueError`` naming the numbers when ``config`` cannot be split over ``size`` ranks."""
    if size < 1:
        raise ValueError(f"tensor_parallel_size must be at least 1, got {size}")
    if config.num_heads % size:
        raise ValueError(
            f"tensor_parallel_size {size} does not divide the {config.num_heads} query heads of {config.name}"
        )
    kv = config.num_kv_heads
    if (size <= kv and kv % size) or (size > kv and size % kv):
        raise ValueError(
            f"tensor_parallel_size {size} must divide the {kv} KV heads of {config.name} "
            f"or be a multiple of them (KV heads are replicated then)"
        )
    if config.intermediate_size % size:
        raise ValueError(f"tensor_parallel_size {size} does not divide the MLP size "
                         f"{config.intermediate_size} of {config.name}")
    if config.moe is not None and config.moe.intermediate_size % size:
        raise ValueError(f"tensor_parallel_size {size} does not divide the experts' MLP size "
                         f"{config.moe.intermediate_size} of {config.name}")
    if config.moe is not None and config.moe.shared_intermediate_size % size:
        raise ValueError(f"tensor_parallel_size {size} does not divide the shared experts' MLP size "
                         f"{config.moe.shared_intermediate_size} of {config.name}")

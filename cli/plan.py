"""``pdserve plan``: how much KV cache a device holds for a model, before anyone buys one.

KV bytes per token = 2 x layers x KV heads x head dim x bytes per element (the
engine's own formula, ``engine.kv_sizing``), per KV group of a hybrid model
(``engine/kv_groups.py``: its full-attention layers and its sliding-window layers,
whose blocks a sequence holds for at most its window); the plan's
``kv_bytes_per_token`` is every layer's, as if all attended to everything.
Blocks hold one slot per layer of a group, and a sequence of N tokens holds each
group's blocks (``blocks_per_sequence``), as the engine keeps them. A mixture of
experts also reports its active parameters per token (``engine/models/size.py``). The KV budget is either
``--kv-cache-memory`` (what the CPU engine takes as its budget) or
``--device-memory`` x ``--gpu-memory-utilization`` minus the weights (what the
CUDA engine computes, with the weights as the memory already in use). The
budget buys whole blocks of ``--block-size`` tokens; a sequence of
``--max-model-len`` tokens needs ceil(len / block size) blocks, so the
concurrent sequences are blocks // that. Weights count what a CUDA device holds
(``--weight-memory`` says otherwise): under ``--dtype auto``, the engine's default,
bfloat16 with the quantized records the engine keeps counted as their bytes (an
fp8 checkpoint's codes, MXFP4 experts, a GGUF's blocks:
``engine/models/held.py``); under an explicit ``--dtype`` every parameter at it
(the engine dequantizes on load, GGUF included).

Below the plan for ``--kv-cache-dtype``, a table sizes the same budget for every
KV storage dtype side by side (the ``--dtype`` one, ``fp8``, ``fp8_e5m2``,
``int8``): bytes per token with the scales of a quantized block spread over its
tokens, blocks, tokens and sequences at ``--max-model-len``; with
``--kv-offload-bytes`` (and ``--kv-offload-disk-bytes``) also the whole blocks
the host (and disk) offload tier holds, ``bytes // block bytes`` as
``engine/offload.py`` keeps them.

With ``--tensor-parallel-size N`` every figure is per device: the weights of one
rank's shard (``engine.models.size.parameter_count``: its heads, its
MLP columns, ceil(vocab / N) rows of the embedding and head; norms replicated),
and its KV heads (KV heads / N, at least one: replicated past that), so the
blocks are those one rank's budget buys, as the engine allocates them; a sequence
takes the same block ids on every rank, so the concurrent sequences are one
device's. ``--prefill-tp`` / ``--decode-tp`` print one plan per role.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.checkpoint_quant import CheckpointQuant, checkpoint_quant
from engine.config import ModelConfig, parse_dtype
from engine.hf_loader import read_checkpoint_quant
from engine.kv_groups import KvGroup, blocks_per_sequence, kv_layout, num_slots
from engine.models.held import Held, held_bytes
from engine.models.size import parameter_count as count_parameters
from engine.tensor_parallel import TpShard

DEFAULT_DEVICE_MEMORY = 80 * 1024**3
CONTEXT_LENGTHS = (2048, 8192, 32768, 131072)


def parameter_count(model: ModelConfig) -> int:
    """Parameters of the model from its shape (``engine/models/size.py``: every family's layers)."""
    return count_parameters(model).total


def read_model_config(path: str | Path) -> ModelConfig:
    """A model folder, a ``.gguf`` file or a bare ``config.json``, read by the engine's loaders."""
    from engine.gguf_loader import read_gguf_config
    from engine.hf_loader import read_hf_config, read_hf_config_file

    path = Path(path).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"model path not found: {path} (expected a folder, a .gguf or a config.json)")
    if path.is_dir():
        return read_hf_config(path)
    if path.suffix.lower() == ".gguf":
        return read_gguf_config(path)
    if path.suffix.lower() == ".json":
        return read_hf_config_file(path)
    raise ValueError(f"unknown model file type: {path} (expected a folder, a .gguf or a config.json)")


def read_quant(path: Path) -> CheckpointQuant | None:
    """The ``quantization_config`` of a model folder or a bare ``config.json`` (None for a GGUF)."""
    if path.is_dir():
        return read_checkpoint_quant(path)
    if path.suffix.lower() == ".json":
        return checkpoint_quant(json.loads(path.read_text()), path)
    return None


@dataclass(frozen=True)
class DtypeCapacity:
    """What the plan's budget (and offload tiers) hold at one KV storage dtype.

    ``kv_bytes_per_token`` counts the codes only; ``block_bytes_per_token`` is
    ``kv_block_bytes / block_size`` (scales included). ``host_*`` / ``disk_*`` are
    ``None`` when that tier's size was not given.
    """

    kv_cache_dtype: str
    kv_bytes_per_token: int
    kv_block_bytes: int
    block_bytes_per_token: float
    num_kv_blocks: int
    kv_tokens: int
    concurrent_sequences: int
    host_blocks: int | None
    host_tokens: int | None
    disk_blocks: int | None
    disk_tokens: int | None
    selected: bool = False  # the plan's --kv-cache-dtype


@dataclass(frozen=True)
class KvGroupPlan:
    """One kind of layer's share of the KV: ``groups`` KV groups of ``layers`` layers in all, attending
    to a ``window`` of tokens (None: everything), ``kv_bytes_per_token`` for those layers together."""

    attention: str
    window: int | None
    layers: int
    groups: int
    kv_bytes_per_token: int


@dataclass(frozen=True)
class Plan:
    model: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    parameters: int
    weight_bytes: int
    dtype: str
    kv_cache_dtype: str
    kv_bytes_per_token: int
    block_size: int
    kv_block_bytes: int
    device_memory: int | None
    gpu_memory_utilization: float | None
    kv_budget_bytes: int
    num_kv_blocks: int
    kv_tokens: int
    max_model_len: int
    blocks_per_sequence: int
    concurrent_sequences: int
    sequences_at: dict[int, int]
    kv_offload_bytes: int | None = None
    kv_offload_disk_bytes: int | None = None
    by_kv_dtype: list[DtypeCapacity] | None = None
    tensor_parallel_size: int = 1
    kv_heads_per_device: int = 0  # one rank's KV heads (replicated when N exceeds the model's)
    role: str | None = None  # prefill / decode for a per-role plan
    architecture: str = ""
    active_parameters: int = 0  # what one token's forward reads (the routed experts only)
    active_weight_bytes: int = 0
    kv_groups: list[KvGroupPlan] | None = None
    kv_block_slots: int = 0  # layers a block holds
    latent_dim: int = 0  # MLA: values cached per token per layer (no KV heads)
    kept_records: bool = False  # the weights count quantized records as their bytes (--dtype auto)


def make_plan(model: ModelConfig, *, dtype: str = "auto", kv_cache_dtype: str = "auto",
              block_size: int = 16, device_memory: int = DEFAULT_DEVICE_MEMORY,
              gpu_memory_utilization: float = 0.9, kv_cache_memory: int | None = None,
              max_model_len: int | None = None, weight_memory: int | None = None,
              kv_offload_bytes: int | None = None, kv_offload_disk_bytes: int | None = None,
              tensor_parallel_size: int = 1, role: str | None = None,
              quant: CheckpointQuant | None = None, gguf: Path | None = None) -> Plan:
    """Size the KV cache with ``engine.kv_sizing`` (the functions the engine itself calls), per device.
    ``quant`` (a checkpoint's quantization) and ``gguf`` (the model's file) tell ``dtype="auto"`` which
    records the weights keep."""
    from engine.kv_sizing import (
        KV_CACHE_DTYPES,
        blocks_for_budget,
        device_kv_budget,
        element_bytes,
        kv_block_bytes,
        kv_bytes_per_layer_token,
        kv_dtype_name,
    )

    weights_dtype = parse_dtype("bfloat16" if dtype == "auto" else dtype)  # auto: bfloat16, as on CUDA
    kv_name = str(weights_dtype)[6:] if kv_cache_dtype == "auto" else kv_cache_dtype
    kv_dtype = KV_CACHE_DTYPES.get(kv_name) or parse_dtype(kv_name)
    counts = count_parameters(model)
    params = counts.total
    shard = TpShard(model, 0, tensor_parallel_size)
    full_model, model = model, shard.kv_config  # KV sized by one device's heads
    groups = kv_layout(full_model)
    slots = num_slots(groups)
    width = element_bytes(weights_dtype)
    floats = count_parameters(full_model, shard).total * width
    held = (held_bytes(full_model, width, quant, gguf, tensor_parallel_size) if dtype == "auto"
            else Held(floats))
    weights = weight_memory // tensor_parallel_size if weight_memory is not None else held.total
    kept = held.total != floats  # some matrices count as their records
    inactive = 0.0  # the share of the experts' bytes a token does not read
    if full_model.moe is not None and held.experts:
        inactive = held.experts * (1 - full_model.moe.top_k / full_model.moe.num_experts)
    if kv_cache_memory is not None:
        budget = kv_cache_memory
    else:
        budget = device_kv_budget(device_memory, gpu_memory_utilization, weights)
    blocks = blocks_for_budget(model, block_size, kv_dtype, budget, slots)
    length = max_model_len or model.max_position_embeddings
    per_seq = blocks_per_sequence(groups, length, block_size)
    lengths = sorted({n for n in CONTEXT_LENGTHS if n < length} | {length})
    quantized = ["fp8", "fp8_e5m2", "int8", "int4"]
    chosen = kv_dtype_name(kv_dtype)
    extra = [] if chosen in quantized else [chosen]
    names = dict.fromkeys([kv_dtype_name(weights_dtype), *extra, *quantized])
    by_dtype = [dataclasses.replace(dtype_capacity(model, KV_CACHE_DTYPES[n], block_size, budget, per_seq,
                                                   kv_offload_bytes, kv_offload_disk_bytes, slots),
                                    selected=n == chosen) for n in names]
    return Plan(
        model=model.name, num_layers=model.num_layers, num_kv_heads=full_model.num_kv_heads,
        head_dim=model.head_dim, parameters=params, weight_bytes=weights, dtype=str(weights_dtype)[6:],
        kept_records=kept,
        kv_cache_dtype=kv_dtype_name(kv_dtype) if kv_dtype == torch.uint8 else str(kv_dtype)[6:],
        kv_bytes_per_token=kv_bytes_per_layer_token(model, kv_dtype) * model.num_layers,
        block_size=block_size, kv_block_bytes=kv_block_bytes(model, block_size, kv_dtype, slots),
        device_memory=None if kv_cache_memory is not None else device_memory,
        gpu_memory_utilization=None if kv_cache_memory is not None else gpu_memory_utilization,
        kv_budget_bytes=budget, num_kv_blocks=blocks, kv_tokens=blocks * block_size,
        max_model_len=length, blocks_per_sequence=per_seq, concurrent_sequences=blocks // per_seq,
        sequences_at={n: blocks // blocks_per_sequence(groups, n, block_size) for n in lengths},
        kv_offload_bytes=kv_offload_bytes, kv_offload_disk_bytes=kv_offload_disk_bytes, by_kv_dtype=by_dtype,
        tensor_parallel_size=tensor_parallel_size, kv_heads_per_device=model.num_kv_heads, role=role,
        architecture=full_model.architecture, active_parameters=counts.active,
        active_weight_bytes=round(held.total - inactive) if kept else counts.active * width,
        kv_groups=group_plans(model, groups, kv_bytes_per_layer_token(model, kv_dtype)), kv_block_slots=slots,
        latent_dim=model.mla.latent_dim if model.mla is not None else 0,
    )


def group_plans(model: ModelConfig, groups: tuple[KvGroup, ...], per_layer: int) -> list[KvGroupPlan]:
    """The KV groups by attention kind: full attention first, then each window."""
    kinds: dict[int | None, list[KvGroup]] = {}
    for g in groups:
        kinds.setdefault(g.window, []).append(g)
    plans = []
    for window, gs in kinds.items():
        layers = sum(len(g.layers) for g in gs)
        kind = "full" if window is None else "sliding"
        plans.append(KvGroupPlan(kind, window, layers, len(gs), per_layer * layers))
    return plans


def dtype_capacity(model: ModelConfig, kv_dtype: torch.dtype, block_size: int, budget: int,
                   blocks_per_sequence: int, host_bytes: int | None = None,
                   disk_bytes: int | None = None, slots: int | None = None) -> DtypeCapacity:
    """One row of the per-dtype table, from ``engine.kv_sizing`` (as the engine and its tiers size)."""
    from engine.kv_sizing import (
        blocks_for_budget,
        kv_block_bytes,
        kv_bytes_per_layer_token,
        kv_dtype_name,
        tier_capacity_blocks,
    )

    block = kv_block_bytes(model, block_size, kv_dtype, slots)
    blocks = blocks_for_budget(model, block_size, kv_dtype, budget, slots)
    host = None if host_bytes is None else tier_capacity_blocks(host_bytes, block)
    disk = None if disk_bytes is None else tier_capacity_blocks(disk_bytes, block)
    return DtypeCapacity(
        kv_cache_dtype=kv_dtype_name(kv_dtype),
        kv_bytes_per_token=kv_bytes_per_layer_token(model, kv_dtype) * model.num_layers,
        kv_block_bytes=block, block_bytes_per_token=block / block_size, num_kv_blocks=blocks,
        kv_tokens=blocks * block_size, concurrent_sequences=blocks // blocks_per_sequence,
        host_blocks=host, host_tokens=None if host is None else host * block_size,
        disk_blocks=disk, disk_tokens=None if disk is None else disk * block_size,
    )

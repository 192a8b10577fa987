"""How many KV blocks a memory budget buys. ``pdserve plan`` uses the same functions.

KV bytes per token = 2 (K and V) x layers x KV heads x head dim x bytes per
element (half a byte for int4, ``kernels/kv_int4.py``); a block holds
``block_size`` tokens of ``slots`` layers: every layer for a
model of one KV group, one group's layers for a hybrid model (``engine/kv_groups.py``).
``slots`` None means every layer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from engine.config import EngineConfig, ModelConfig
from kernels.kv_quant import SCALE_DTYPE, is_quantized, scale_shape, stored_head_dim

# Bytes per KV element for each name ``--kv-cache-dtype`` accepts (``auto`` means the model dtype).
KV_CACHE_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
    "int8": torch.int8,
    "int4": torch.uint8,  # kernels/kv_int4.py: uint8 bytes of two codes
}

# The name ``/metrics`` and ``pdserve plan`` give each storage dtype (``--kv-cache-dtype``'s spelling).
_DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float32: "float32",
    torch.bfloat16: "bfloat16",
    torch.float16: "float16",
    torch.float8_e4m3fn: "fp8",
    torch.float8_e5m2: "fp8_e5m2",
    torch.int8: "int8",
    torch.uint8: "int4",
}


def kv_dtype_name(dtype: torch.dtype) -> str:
    """``fp8`` for float8_e4m3fn, ``fp8_e5m2``, ``int8``, ``int4`` (its uint8 bytes), else the torch name
    (``float32``...)."""
    return _DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))


@dataclass(frozen=True)
class KvTier:
    """One KV tier of an engine in whole blocks of ``block_bytes`` (K/V codes plus scales).

    ``tier`` is ``device`` (the paged cache; ``used_blocks`` held by requests or
    leases), ``host`` or ``disk`` (the offload tiers; ``used_blocks`` stored there,
    ``hits`` blocks restored from there since start).
    """

    tier: str
    capacity_blocks: int
    used_blocks: int
    block_bytes: int
    hits: int = 0


def tier_capacity_blocks(capacity_bytes: int, block_bytes: int) -> int:
    """Whole blocks an offload tier of ``capacity_bytes`` holds (its LRU evicts past that)."""
    return max(capacity_bytes, 0) // block_bytes


def element_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def kv_block_bytes(model: ModelConfig, block_size: int, dtype: torch.dtype, slots: int | None = None) -> int:
    """Bytes of one block over its slots: block_size x parts x slots x kv_heads x KV head dim x elem
    (parts: K and V, or MLA's one latent).

    A quantized dtype adds its scales: 2 x slots x kv_heads float32 per block for fp8/int8
    (``kernels/kv_quant.py``), times 2 x groups for int4's ``(low, step)`` pairs, whose codes take half a
    byte each (``kernels/kv_int4.py``), so the count stays honest.
    """
    layers = model.num_layers if slots is None else slots
    per_token = kv_bytes_per_layer_token(model, dtype) * layers
    return block_size * per_token + kv_scale_bytes(model, dtype, slots)


def kv_scale_bytes(model: ModelConfig, dtype: torch.dtype, slots: int | None = None) -> int:
    """Scale bytes of one block over its slots: 0 unless ``dtype`` is quantized."""
    if not is_quantized(dtype):
        return 0
    layers = model.num_layers if slots is None else slots
    entries = math.prod(scale_shape(dtype, model.kv_head_dim))
    return model.kv_parts * layers * model.num_kv_heads * entries * SCALE_DTYPE.itemsize


def kv_bytes_per_layer_token(model: ModelConfig, dtype: torch.dtype) -> int:
    """Code bytes one token takes in one layer (K and V, or the latent; scales not counted)."""
    row = stored_head_dim(dtype, model.kv_head_dim) * element_bytes(dtype)
    return model.kv_parts * model.num_kv_heads * row


def blocks_for_budget(model: ModelConfig, block_size: int, dtype: torch.dtype, budget: int,
                      slots: int | None = None) -> int:
    """Whole blocks that fit in ``budget`` bytes (0 when not even one does)."""
    return max(budget, 0) // kv_block_bytes(model, block_size, dtype, slots)


def device_kv_budget(total_memory: int, utilization: float, used_bytes: int) -> int:
    """The KV budget on an accelerator: ``utilization`` of its memory minus what is already used."""
    return int(total_memory * utilization) - used_bytes


def num_kv_blocks(model: ModelConfig, engine: EngineConfig, slots: int | None = None) -> int:
    """Blocks for the engine's budget: ``--num-kv-blocks`` if set, else the memory budget.

    On CPU the budget is ``--kv-cache-memory`` bytes. On CUDA it is
    ``gpu_memory_utilization`` of the device's total memory minus what is
    already allocated (weights included) when the cache is sized.
    """
    if engine.num_kv_blocks is not None:
        return engine.num_kv_blocks
    block = kv_block_bytes(model, engine.block_size, engine.kv_torch_dtype, slots)
    if engine.device.startswith("cuda"):
        device = torch.device(engine.device)
        total = torch.cuda.get_device_properties(device).total_memory
        budget = device_kv_budget(total, engine.gpu_memory_utilization, torch.cuda.memory_allocated(device))
    else:
        budget = engine.kv_cache_memory
    blocks = blocks_for_budget(model, engine.block_size, engine.kv_torch_dtype, budget, slots)
    if blocks < 1:
        raise ValueError(
            f"the KV budget of {budget} bytes holds no block of {block} bytes; "
            "raise --kv-cache-memory (or --gpu-memory-utilization) or set --num-kv-blocks"
        )
    return blocks

"""How many KV blocks a memory budget buys. ``pdserve plan`` uses the same formula."""

from __future__ import annotations

import torch

from engine.config import EngineConfig, ModelConfig
from kernels.kv_quant import SCALE_DTYPE, is_quantized


def kv_block_bytes(model: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one block over all layers: block_size x 2 x layers x kv_heads x head_dim x elem.

    A quantized dtype (fp8/int8) adds its scales: 2 x layers x kv_heads float32 per block
    (``kernels/kv_quant.py``), so the count stays honest.
    """
    element = torch.empty((), dtype=dtype).element_size()
    return block_size * model.kv_bytes_per_token(element) + kv_scale_bytes(model, dtype)


def kv_scale_bytes(model: ModelConfig, dtype: torch.dtype) -> int:
    """Scale bytes of one block over all layers: 0 unless ``dtype`` is quantized."""
    if not is_quantized(dtype):
        return 0
    return 2 * model.num_layers * model.num_kv_heads * SCALE_DTYPE.itemsize


def num_kv_blocks(model: ModelConfig, engine: EngineConfig, weight_bytes: int = 0) -> int:
    """Blocks for the engine's budget: ``--num-kv-blocks`` if set, else the memory budget.

    On CPU the budget is ``--kv-cache-memory`` bytes. On CUDA it is
    ``gpu_memory_utilization`` of the device's total memory minus what is
    already allocated (weights included) when the cache is sized.
    """
    if engine.num_kv_blocks is not None:
        return engine.num_kv_blocks
    block = kv_block_bytes(model, engine.block_size, engine.kv_torch_dtype)
    if engine.device.startswith("cuda"):
        device = torch.device(engine.device)
        total = torch.cuda.get_device_properties(device).total_memory
        budget = int(total * engine.gpu_memory_utilization) - torch.cuda.memory_allocated(device)
    else:
        budget = engine.kv_cache_memory
    blocks = budget // block
    if blocks < 1:
        raise ValueError(
            f"the KV budget of {budget} bytes holds no block of {block} bytes; "
            "raise --kv-cache-memory (or --gpu-memory-utilization) or set --num-kv-blocks"
        )
    return blocks

"""The paged KV cache's tensors (layout: ``kernels/attention.py``)."""

from __future__ import annotations

import torch

from engine.config import ModelConfig
from kernels.kv_quant import scale_shape, stored_head_dim


def allocate_kv_cache(
    config: ModelConfig,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
    slots: int | None = None,
) -> torch.Tensor:
    """Zeros of shape ``[slots, num_blocks, parts, block_size, num_kv_heads, kv_head_dim]`` (``slots``:
    every layer's unless given, ``engine/kv_groups.py``; parts 2 for K and V, 1 for MLA's latent, whose
    one "head" is the latent and rotary key together). An int4 cache's last dimension is half that: two
    channels a byte (``kernels/kv_int4.py``)."""
    if dtype == torch.uint8 and config.mla is not None:
        raise ValueError("--kv-cache-dtype int4 does not store latent attention (MLA) caches; "
                         "use fp8 or int8")
    layers = config.num_layers if slots is None else slots
    shape = (layers, num_blocks, config.kv_parts, block_size, config.num_kv_heads,
             stored_head_dim(dtype, config.kv_head_dim))
    return torch.zeros(shape, dtype=dtype, device=device)


def allocate_kv_scales(config: ModelConfig, num_blocks: int, device: torch.device | str,
                       slots: int | None = None, dtype: torch.dtype = torch.int8) -> torch.Tensor:
    """Ones of shape ``[slots, num_blocks, parts, num_kv_heads]`` float32 for an fp8/int8 cache
    (``kernels/kv_quant.py``); an int4 cache's (``dtype`` uint8) adds ``[groups, 2]`` of ``(low, step)``,
    zeros (``kernels/kv_int4.py``)."""
    shape = (config.num_layers if slots is None else slots, num_blocks, config.kv_parts, config.num_kv_heads,
             *scale_shape(dtype, config.kv_head_dim))
    fill = torch.zeros if len(shape) > 4 else torch.ones
    return fill(shape, dtype=torch.float32, device=device)

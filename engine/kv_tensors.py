"""The paged KV cache's tensors (layout: ``kernels/attention.py``)."""

from __future__ import annotations

import torch

from engine.config import ModelConfig


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
    one "head" is the latent and rotary key together)."""
    layers = config.num_layers if slots is None else slots
    shape = (layers, num_blocks, config.kv_parts, block_size, config.num_kv_heads, config.kv_head_dim)
    return torch.zeros(shape, dtype=dtype, device=device)


def allocate_kv_scales(config: ModelConfig, num_blocks: int, device: torch.device | str,
                       slots: int | None = None) -> torch.Tensor:
    """Ones of shape ``[slots, num_blocks, parts, num_kv_heads]`` float32 (``kernels/kv_quant.py``)."""
    shape = (config.num_layers if slots is None else slots, num_blocks, config.kv_parts, config.num_kv_heads)
    return torch.ones(shape, dtype=torch.float32, device=device)

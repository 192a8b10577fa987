"""Which blocks a step's KV write touches, and which rows of each: shared by the quantized writers
(``kernels/kv_quant.py``, ``kernels/kv_int4.py``), which rebuild every touched block."""

from __future__ import annotations

from typing import NamedTuple

import torch


class TouchedBlocks(NamedTuple):
    """``touched``: the distinct block ids; ``inverse``: each slot's index into them; ``offsets``: each
    slot's row in its block; ``start``/``end``: the first and last row written in each touched block."""

    touched: torch.Tensor
    inverse: torch.Tensor
    offsets: torch.Tensor
    start: torch.Tensor
    end: torch.Tensor


def touched_blocks(slots: torch.Tensor, block_size: int) -> TouchedBlocks:
    blocks = torch.div(slots, block_size, rounding_mode="floor")
    offsets = slots % block_size
    touched, inverse = torch.unique(blocks, return_inverse=True)
    u = touched.numel()
    start = torch.full((u,), block_size, dtype=torch.int64, device=slots.device)
    start = start.scatter_reduce(0, inverse, offsets, "amin")
    end = torch.full((u,), -1, dtype=torch.int64, device=slots.device)
    end = end.scatter_reduce(0, inverse, offsets, "amax")
    return TouchedBlocks(touched, inverse, offsets, start, end)

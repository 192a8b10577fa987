"""Gated activations."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up = [gate | up]`` on the last dim, in one new tensor.

    Same operations and rounding as ``F.silu(gate) * up``; the product is written
    into the SiLU output, so one intermediate is allocated instead of two.
    """
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)

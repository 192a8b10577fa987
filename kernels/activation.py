"""Gated activations."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up = [gate | up]`` on the last dim, in one new tensor.

    Same operations and rounding as ``F.silu(gate) * up``; the product is written
    into the SiLU output, so one intermediate is allocated instead of two.
    """
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``gelu_tanh(gate) * up`` for ``gate_up = [gate | up]`` on the last dim (Gemma's gated MLP)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh").mul_(up)


def gated_activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The gated activation ``silu`` or ``gelu_tanh`` over ``[gate | up]``."""
    if name == "silu":
        return silu_mul
    if name == "gelu_tanh":
        return gelu_tanh_mul
    raise ValueError(f"unknown gated activation {name!r}; known: silu, gelu_tanh")

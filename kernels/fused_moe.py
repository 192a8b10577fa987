"""``fused_moe``: the mixture-of-experts computation of ``kernels/moe.py``'s contract, dispatched: the
Triton kernels (``kernels/triton_moe.py``) on CUDA with Triton installed, else the torch reference."""

from __future__ import annotations

import importlib.util

import torch

from kernels.moe import MoeActivation, fused_moe_reference


def triton_moe_available(device: torch.device) -> bool:
    return device.type == "cuda" and importlib.util.find_spec("triton") is not None


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, activation: MoeActivation, b13: torch.Tensor | None = None,
              b2: torch.Tensor | None = None) -> torch.Tensor:
    """The experts' weighted sum (module docstring): the Triton kernels on CUDA, else the reference."""
    if triton_moe_available(x.device):
        from kernels.triton_moe import triton_fused_moe

        return triton_fused_moe(x, w13, w2, topk_weights, topk_ids, activation, b13, b2)
    return fused_moe_reference(x, w13, w2, topk_weights, topk_ids, activation, b13, b2)

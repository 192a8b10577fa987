"""Tensor math for pdserve: paged attention backends, rope and norms."""

from __future__ import annotations

import torch

from kernels.attention import AttentionBackend, AttentionMetadata
from kernels.torch_ref import TorchAttentionBackend

__all__ = ["AttentionBackend", "AttentionMetadata", "TorchAttentionBackend", "get_attention_backend"]


def get_attention_backend(device: torch.device | str) -> AttentionBackend:
    """The attention backend for ``device``: the torch reference everywhere for now.

    A flashinfer backend for CUDA will be imported lazily here, so CPU-only
    installs never need flashinfer.
    """
    torch.device(device)
    return TorchAttentionBackend()

"""Tensor math for pdserve: paged attention backends, rope and norms."""

from __future__ import annotations

import torch

from kernels.attention import AttentionBackend, AttentionMetadata
from kernels.cpu_native import NativeCpuAttentionBackend, native_available
from kernels.torch_ref import TorchAttentionBackend

__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "NativeCpuAttentionBackend",
    "TorchAttentionBackend",
    "get_attention_backend",
    "native_available",
]


def get_attention_backend(device: torch.device | str) -> AttentionBackend:
    """The attention backend for ``device``.

    On CPU: the native paged kernel when it builds here (``PDSERVE_NATIVE_KERNELS=0``
    turns it off); it hands dtypes it does not support to the torch reference
    itself. Elsewhere the torch reference for now; a flashinfer backend for CUDA
    will be imported lazily here, so CPU-only installs never need flashinfer.
    """
    if torch.device(device).type == "cpu" and native_available():
        return NativeCpuAttentionBackend()
    return TorchAttentionBackend()

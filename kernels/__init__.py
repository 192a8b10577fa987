"""Tensor math for pdserve: paged attention backends, rope and norms."""

from __future__ import annotations

import importlib.util
import os

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


def get_attention_backend(device: torch.device | str, name: str = "auto",
                          kv_quantized: bool = False) -> AttentionBackend:
    """The attention backend ``name`` (``auto``, ``triton``, ``flashinfer`` or ``torch``) for ``device``.

    ``auto`` on CPU: the native paged kernel when it builds here (``EngineConfig.native_kernels``
    off asks for ``torch`` instead), which hands dtypes it does not support to the torch reference itself;
    on CUDA: flashinfer when installed and the cache is not quantized (flashinfer cannot read
    our per-block fp8/int8 scales, see ``kernels/flashinfer_backend.py``), else Triton, else
    the torch reference. The CUDA
    backends are imported only when chosen, so CPU-only installs never need them.
    Triton on CPU runs only under ``TRITON_INTERPRET=1`` (the tests).
    """
    kind = torch.device(device).type
    if name == "auto":
        if kind == "cpu":
            return NativeCpuAttentionBackend() if native_available() else TorchAttentionBackend()
        if kind == "cuda" and not kv_quantized and importlib.util.find_spec("flashinfer") is not None:
            name = "flashinfer"
        elif kind == "cuda" and importlib.util.find_spec("triton") is not None:
            name = "triton"
        else:
            name = "torch"
    if name == "torch":
        return TorchAttentionBackend()
    if name == "triton":
        if kind != "cuda" and os.environ.get("TRITON_INTERPRET", "0") != "1":
            raise ValueError(f"attention_backend='triton' needs a CUDA device, got {kind!r}")
        from kernels.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    if name == "flashinfer":
        if kv_quantized:
            raise ValueError("attention_backend='flashinfer' cannot read a quantized (fp8/int8) KV cache; "
                             "use 'triton' or 'auto'")
        if kind != "cuda":
            raise ValueError(f"attention_backend='flashinfer' needs a CUDA device, got {kind!r}")
        from kernels.flashinfer_backend import FlashInferAttentionBackend

        return FlashInferAttentionBackend(device)
    raise ValueError(f"attention_backend must be auto, triton, flashinfer or torch, got {name!r}")

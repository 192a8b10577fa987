"""RMSNorm, bit-identical to transformers' ``LlamaRMSNorm``."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalise the last dim in float32, cast back to ``x.dtype``, then scale by ``weight``.

    ``F.rms_norm`` reduces in the same order as transformers' ``pow(2).mean()``;
    ``test_rms_norm_matches_transformers`` holds it to bitwise equality.
    """
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    normed = F.rms_norm(x.to(torch.float32), (x.shape[-1],), None, eps)
    return weight * normed.to(x.dtype)


def rms_norm_offset(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm: normalise in float32, scale by ``1 + weight`` in float32, cast back to ``x.dtype``
    (transformers' ``Gemma3RMSNorm``; checkpoints store ``weight`` around 0, not around 1)."""
    normed = F.rms_norm(x.to(torch.float32), (x.shape[-1],), None, eps)
    return (normed * (1.0 + weight.to(torch.float32))).to(x.dtype)

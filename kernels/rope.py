"""Rotary position embedding in the Hugging Face Llama convention.

Frequencies follow transformers' rope init functions exactly (``default``,
``linear``, ``llama3`` and ``yarn``, whose attention factor scales cos and sin as
transformers does); cos/sin are computed in float32 for the step's positions and
cast to the activation dtype, and the rotation is the non-interleaved "rotate_half"
form (the first half of ``head_dim`` pairs with the second half).
"""

from __future__ import annotations

import math
from typing import Protocol

import torch

ROPE_TYPES = ("default", "linear", "llama3", "yarn")


class RopeScalingParams(Protocol):
    """What rope needs from ``engine.config.RopeScaling`` (kernels never import engine)."""

    @property
    def rope_type(self) -> str: ...
    @property
    def factor(self) -> float: ...
    @property
    def low_freq_factor(self) -> float: ...
    @property
    def high_freq_factor(self) -> float: ...
    @property
    def original_max_position_embeddings(self) -> int: ...
    @property
    def beta_fast(self) -> float: ...
    @property
    def beta_slow(self) -> float: ...
    @property
    def mscale(self) -> float | None: ...
    @property
    def mscale_all_dim(self) -> float | None: ...
    @property
    def attention_factor(self) -> float | None: ...
    @property
    def truncate(self) -> bool: ...


def rope_inv_freq(head_dim: int, rope_theta: float, scaling: RopeScalingParams) -> torch.Tensor:
    """Inverse frequencies ``[head_dim // 2]`` in float32, as transformers computes them."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = 1.0 / (rope_theta**exponents)
    if scaling.rope_type == "default":
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    if scaling.rope_type == "yarn":
        return _yarn_inv_freq(head_dim, rope_theta, scaling)
    raise ValueError(f"unsupported rope_type {scaling.rope_type!r}; supported: {', '.join(ROPE_TYPES)}")


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: RopeScalingParams) -> torch.Tensor:
    factor = scaling.factor
    low_freq_factor = scaling.low_freq_factor
    high_freq_factor = scaling.high_freq_factor
    old_context_len = scaling.original_max_position_embeddings
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor

    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth_factor = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed_inv_freq = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
    is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium_freq, smoothed_inv_freq, inv_freq_llama)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_attention_factor(scaling: RopeScalingParams) -> float:
    """The factor cos and sin are multiplied by: 1 except for YaRN (its ``attention_factor``, or the
    one derived from ``factor``, ``mscale`` and ``mscale_all_dim`` as transformers derives it)."""
    if scaling.rope_type != "yarn":
        return 1.0
    if scaling.attention_factor is not None:
        return float(scaling.attention_factor)
    if scaling.mscale and scaling.mscale_all_dim:
        factor = scaling.factor
        return _yarn_mscale(factor, scaling.mscale) / _yarn_mscale(factor, scaling.mscale_all_dim)
    return _yarn_mscale(scaling.factor)


def _yarn_inv_freq(dim: int, base: float, scaling: RopeScalingParams) -> torch.Tensor:
    """YaRN's blend of interpolated and extrapolated frequencies (transformers'
    ``_compute_yarn_parameters``)."""
    def correction_dim(rotations: float) -> float:
        return (dim * math.log(scaling.original_max_position_embeddings / (rotations * 2 * math.pi))) / (
            2 * math.log(base))

    low, high = correction_dim(scaling.beta_fast or 32), correction_dim(scaling.beta_slow or 1)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (scaling.factor * pos_freqs)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp
    return interpolation * (1 - keep) + extrapolation * keep


class RotaryEmbedding:
    """Holds the inverse frequencies; ``cos_sin`` once per step, ``apply`` per layer."""

    def __init__(
        self,
        head_dim: int,
        rope_theta: float,
        scaling: RopeScalingParams,
        device: torch.device | str = "cpu",
    ) -> None:
        if head_dim % 2:
            raise ValueError(f"rotary embedding needs an even head_dim, got {head_dim}")
        self.head_dim = head_dim
        self.inv_freq = rope_inv_freq(head_dim, rope_theta, scaling).to(device)
        self.attention_factor = rope_attention_factor(scaling)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos``/``sin`` of shape ``[T, 1, head_dim]`` (broadcast over heads) in ``dtype``."""
        freqs = positions[:, None].to(torch.float32) * self.inv_freq.to(positions.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos.to(dtype)[:, None, :], sin.to(dtype)[:, None, :]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` (``[T, heads, head_dim]``) by the per-token angles in ``cos``/``sin``."""
    return (x * cos) + (rotate_half(x) * sin)


def apply_rotary_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent pairs ``(x[2i], x[2i+1])`` of ``x``'s last dim by frequency ``i`` (DeepSeek's
    rope layout), given ``RotaryEmbedding.cos_sin``'s full-width ``cos``/``sin``. The result holds the
    rotated even elements, then the rotated odd ones (transformers' layout: queries and keys rotated
    alike, so their dot products are those of the interleaved rotation)."""
    half = cos.shape[-1] // 2
    cos, sin = cos[..., :half], sin[..., :half]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

"""Reading a GGUF file as llama.cpp writes it: ``ModelConfig`` from its metadata, its tensor names.

llama.cpp's converter (``convert_hf_to_gguf.py``) stores a model's config as metadata keys under its
GGUF architecture (``{arch}.embedding_length``, ``{arch}.attention.head_count``, ...) and its tensors
under llama.cpp's names (``blk.N.attn_q.weight``, ``blk.N.ffn_gate_exps.weight``, ...). Each family's
module describes how it reads its architectures with a ``GgufFormat``: its config reader (built on
``base_fields`` and the helpers below, as its Hugging Face reader is built on ``hf_config``), its table
of llama.cpp layer tensor names -> the layer library's names (``LLAMA_LAYERS`` is the one most
families share), and the per-tensor ``fix`` that undoes what the converter changed (``unpermute_qk``
for llama-arch Q/K, ``norm_minus_one`` for Gemma's norms). ``engine/gguf_loader.py`` dequantizes and
yields the tensors under those names; nothing here reads tensor data but ``rope_freqs``.

A table's target names the library tensor under ``model.layers.N.``; ``{kind}`` is the GGUF tensor's
``weight`` or ``bias``, and ``{expert}`` marks llama.cpp's 3-D expert tensors (``[experts, out, in]``,
one expert per slice of the first dimension), yielded as one tensor per expert.

Metadata floats are stored as float32; ``number`` gives back the shortest decimal that rounds to the
stored value (``1e-06``, not ``9.99999997e-07``), the value the converter was given.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.config import FULL_ATTENTION, SLIDING_ATTENTION, ModelConfig, RopeScaling
from engine.gguf_file import GGUFFile, GGUFTensor

GLOBAL_NAMES = {"token_embd": "model.embed_tokens.{kind}", "output_norm": "model.norm.{kind}",
                "output": "lm_head.{kind}"}
# read into the config (llama3 rope scaling), not a weight
CONFIG_TENSORS = ("rope_freqs.weight",)
LLAMA_LAYERS: Mapping[str, str] = {
    "attn_norm": "input_layernorm.{kind}",
    "attn_q": "self_attn.q_proj.{kind}",
    "attn_k": "self_attn.k_proj.{kind}",
    "attn_v": "self_attn.v_proj.{kind}",
    "attn_output": "self_attn.o_proj.{kind}",
    "attn_q_norm": "self_attn.q_norm.{kind}",
    "attn_k_norm": "self_attn.k_norm.{kind}",
    "ffn_norm": "post_attention_layernorm.{kind}",
    "ffn_gate": "mlp.gate_proj.{kind}",
    "ffn_up": "mlp.up_proj.{kind}",
    "ffn_down": "mlp.down_proj.{kind}",
    "ffn_gate_inp": "mlp.gate.{kind}",
    "ffn_gate_exps": "mlp.experts.{expert}.gate_proj.{kind}",
    "ffn_up_exps": "mlp.experts.{expert}.up_proj.{kind}",
    "ffn_down_exps": "mlp.experts.{expert}.down_proj.{kind}",
}
_LAYER = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_GLOBAL = re.compile(r"(\w+)\.(weight|bias)")

TensorFix = Callable[[str, torch.Tensor, ModelConfig], torch.Tensor]
Named = Iterator[tuple[str, torch.Tensor]]


def unchanged(name: str, tensor: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    return tensor


def always(reader: GGUFFile) -> bool:
    return True


def one_to_one(tensors: Named, config: ModelConfig) -> Named:
    yield from tensors


@dataclass(frozen=True)
class GgufFormat:
    """How one family reads the GGUF files of its ``ModelFamily.gguf_architectures``.

    ``config``: the file's ``ModelConfig``; ``layers``: llama.cpp layer tensor stem -> library name (see
    the module docstring); ``fix(library_name, tensor, config)``: undoes the converter's change to one
    tensor (given a tensor-parallel slice of whole heads or rows, it must fix the slice alone);
    ``accepts``: whether this family, of those listing the file's architecture, reads it (llama.cpp
    writes Llama and Mixtral both as ``llama``); ``merge(tensors, config)``: the fixed tensors as the
    model takes them, where the converter split one tensor into several (DeepSeek's ``kv_b_proj``): it
    gets and yields library names, a tensor-parallel rank's slices when a rank reads them."""

    config: Callable[[GGUFFile, Path], ModelConfig]
    layers: Mapping[str, str] = field(default_factory=lambda: LLAMA_LAYERS)
    fix: TensorFix = unchanged
    accepts: Callable[[GGUFFile], bool] = always
    merge: Callable[[Named, ModelConfig], Named] = one_to_one

    def target(self, gguf_name: str) -> str | None:
        """The library name of GGUF tensor ``gguf_name`` (``{expert}`` left in for stacked experts), or
        None for a tensor the config reads; ``ValueError`` for one with no place in the model."""
        match = _LAYER.fullmatch(gguf_name)
        if match is not None:
            layer, stem, kind = match.groups()
            if stem in self.layers:
                return f"model.layers.{layer}." + self.layers[stem].replace("{kind}", kind)
        elif gguf_name in CONFIG_TENSORS:
            return None
        else:
            match = _GLOBAL.fullmatch(gguf_name)
            if match is not None and match.group(1) in GLOBAL_NAMES:
                return GLOBAL_NAMES[match.group(1)].replace("{kind}", match.group(2))
        raise ValueError(f"unexpected tensor {gguf_name!r}")

    def check_tensors(self, reader: GGUFFile, path: Path) -> None:
        """Raise ``ValueError`` naming every tensor of the file this format has no place for."""
        unknown = []
        for tensor in reader.tensors:
            try:
                self.target(tensor.name)
            except ValueError:
                unknown.append(tensor.name)
        if unknown:
            shown = ", ".join(unknown[:8]) + (f" (and {len(unknown) - 8} more)" if len(unknown) > 8 else "")
            arch = reader.fields.get("general.architecture")
            raise ValueError(f"unsupported tensors in {path} (GGUF architecture {arch!r}): {shown}")


def unpermute_qk(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Invert llama.cpp's ``permute`` of a Q or K projection (rows grouped per head)."""
    rows = weight.shape[0]
    half = rows // num_heads // 2
    shaped = weight.reshape(num_heads, half, 2, *weight.shape[1:])
    return shaped.transpose(1, 2).reshape(weight.shape).contiguous()


def llama_qk(name: str, tensor: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    """llama.cpp's converter permutes the Q and K rows of ``llama``-arch models (weights and biases)
    for its interleaved rope; the permutation is within each head, so a slice of whole heads un-permutes
    on its own."""
    if name.endswith(("q_proj.weight", "k_proj.weight", "q_proj.bias", "k_proj.bias")):
        return unpermute_qk(tensor, tensor.shape[0] // config.head_dim)
    return tensor


def norm_minus_one(name: str, tensor: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    """llama.cpp's converter stores Gemma's RMSNorm weights as ``1 + w`` (its norm multiplies by the
    weight): subtract the 1 back, since our Gemma norms compute ``1 + w`` themselves. In float32 ``1 +
    ((1 + w) - 1)`` is ``1 + w`` again, bit for bit, for every ``|w| < 1``."""
    return tensor - 1.0 if name.endswith("norm.weight") else tensor


def tensor(reader: GGUFFile, name: str) -> GGUFTensor | None:
    return next((t for t in reader.tensors if t.name == name), None)


def has_tensor(reader: GGUFFile, name: str) -> bool:
    return tensor(reader, name) is not None


def _decimal(value: float) -> float:
    """A float32-stored value as the shortest decimal that rounds to it (a float64 one unchanged)."""
    single = np.float32(value)
    return float(str(single)) if float(single) == value else value


def _scalar(reader: GGUFFile, key: str, path: Path) -> object:
    """A metadata value; a per-layer array whose entries all agree reads as that entry."""
    value = reader.fields.get(key)
    if isinstance(value, list):
        if not value or any(v != value[0] for v in value):
            raise ValueError(f"unsupported per-layer values of {key!r} in {path}: {value[:8]}")
        return value[0]
    return value


def number(reader: GGUFFile, key: str, path: Path, default: float | None = None) -> float | None:
    value = _scalar(reader, key, path)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return default
    return _decimal(float(value))


def integer(reader: GGUFFile, key: str, path: Path, default: int | None = None) -> int:
    value = _scalar(reader, key, path)
    if isinstance(value, bool) or not isinstance(value, int):
        if default is None:
            raise ValueError(f"missing required metadata {key!r} in {path}")
        return default
    return value


def required_number(reader: GGUFFile, key: str, path: Path) -> float:
    value = number(reader, key, path)
    if value is None:
        raise ValueError(f"missing required metadata {key!r} in {path}")
    return value


def _llama3_factors(theta: float, head_dim: int, scaling: RopeScaling) -> torch.Tensor:
    """The per-frequency divisors llama.cpp's converter writes as ``rope_freqs.weight``."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    original = scaling.original_max_position_embeddings
    low_wavelen = original / scaling.low_freq_factor
    high_wavelen = original / scaling.high_freq_factor
    factors = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(scaling.factor)
        else:
            smooth = (original / wavelen - scaling.low_freq_factor) / (
                scaling.high_freq_factor - scaling.low_freq_factor
            )
            factors.append(1 / ((1 - smooth) / scaling.factor + smooth))
    return torch.tensor(factors, dtype=torch.float64)


def _llama3_scaling(reader: GGUFFile, arch: str, theta: float, head_dim: int, path: Path) -> RopeScaling:
    rope_freqs = tensor(reader, "rope_freqs.weight")
    if rope_freqs is None:
        return RopeScaling()
    stored = torch.from_numpy(np.asarray(rope_freqs.data, dtype=np.float64).reshape(-1))
    original = integer(reader, f"{arch}.rope.scaling.original_context_length", path, 8192)
    guess = RopeScaling(rope_type="llama3", factor=float(stored.max()),
                        original_max_position_embeddings=original)
    expected = _llama3_factors(theta, head_dim, guess)
    if expected.shape != stored.shape or not torch.allclose(expected, stored, rtol=1e-4):
        raise ValueError(
            f"unsupported rope_freqs.weight in {path}: it does not match llama3 rope scaling "
            "with low_freq_factor=1, high_freq_factor=4; load the Hugging Face folder instead"
        )
    return guess


def rope_scaling(reader: GGUFFile, arch: str, theta: float, head_dim: int, path: Path) -> RopeScaling:
    """``{arch}.rope.scaling.*``: none (llama3 when a ``rope_freqs.weight`` says so), linear or YaRN."""
    kind = reader.fields.get(f"{arch}.rope.scaling.type") or "none"
    key = f"{arch}.rope.scaling"
    factor = number(reader, f"{key}.factor", path) or number(reader, f"{arch}.rope.scale_linear", path)
    if kind in ("linear", "yarn") and factor is None:
        raise ValueError(f"missing required metadata '{arch}.rope.scaling.factor' in {path}")
    if kind == "linear":
        return RopeScaling(rope_type="linear", factor=factor or 1.0)
    if kind == "yarn":
        base = RopeScaling()
        context = integer(reader, f"{arch}.context_length", path)
        attention_factor = (number(reader, f"{key}.yarn_attn_factor", path)
                            or number(reader, f"{key}.attn_factor", path))
        return RopeScaling(
            rope_type="yarn", factor=factor or 1.0,
            original_max_position_embeddings=integer(reader, f"{key}.original_context_length", path, context),
            beta_fast=number(reader, f"{key}.yarn_beta_fast", path) or base.beta_fast,
            beta_slow=number(reader, f"{key}.yarn_beta_slow", path) or base.beta_slow,
            attention_factor=attention_factor)
    if kind != "none":
        raise ValueError(f"unsupported rope scaling type {kind!r} in {path}; supported: none, linear, yarn")
    return _llama3_scaling(reader, arch, theta, head_dim, path)


def _token_ids(reader: GGUFFile, *keys: str) -> tuple[int, ...]:
    ids: list[int] = []
    for key in keys:
        value = reader.fields.get(f"tokenizer.ggml.{key}")
        if isinstance(value, int) and value not in ids:
            ids.append(value)
    return tuple(ids)


def base_fields(reader: GGUFFile, path: Path, architecture: str,
                partial_rope: bool = False) -> dict[str, Any]:
    """The ``ModelConfig`` fields every family reads the same way, under the file's GGUF architecture
    (``architecture``: the family's ``ModelConfig.architecture``); ``partial_rope``: the family reads
    ``rope.dimension_count`` itself (DeepSeek's rotary part of each head)."""
    arch = str(reader.fields.get("general.architecture"))
    embed = tensor(reader, "token_embd.weight")
    if embed is None:
        raise ValueError(f"missing tensor 'token_embd.weight' in {path}")
    hidden = integer(reader, f"{arch}.embedding_length", path)
    heads = integer(reader, f"{arch}.attention.head_count", path)
    head_dim = integer(reader, f"{arch}.attention.key_length", path, hidden // heads)
    rotated = integer(reader, f"{arch}.rope.dimension_count", path, head_dim)
    if rotated != head_dim and not partial_rope:
        raise ValueError(f"unsupported partial rope in {path}: {arch}.rope.dimension_count is {rotated}, "
                         f"the head dimension {head_dim}")
    theta = number(reader, f"{arch}.rope.freq_base", path, 10000.0) or 10000.0
    ffn = (integer(reader, f"{arch}.feed_forward_length", path, 0)
           or integer(reader, f"{arch}.expert_feed_forward_length", path, 0))
    if not ffn:
        raise ValueError(f"missing required metadata '{arch}.feed_forward_length' in {path}")
    bos = reader.fields.get("tokenizer.ggml.bos_token_id")
    return dict(
        architecture=architecture,
        vocab_size=int(embed.shape[-1]),
        hidden_size=hidden,
        intermediate_size=ffn,
        num_layers=integer(reader, f"{arch}.block_count", path),
        num_heads=heads,
        num_kv_heads=integer(reader, f"{arch}.attention.head_count_kv", path, heads),
        head_dim=head_dim,
        rms_norm_eps=required_number(reader, f"{arch}.attention.layer_norm_rms_epsilon", path),
        rope_theta=theta,
        max_position_embeddings=integer(reader, f"{arch}.context_length", path),
        tie_word_embeddings=not has_tensor(reader, "output.weight"),
        attention_bias=has_tensor(reader, "blk.0.attn_q.bias"),
        rope_scaling=rope_scaling(reader, arch, theta, head_dim, path),
        bos_token_id=bos if isinstance(bos, int) else None,
        eos_token_ids=_token_ids(reader, "eos_token_id", "eot_token_id", "eom_token_id"),
        name=path.stem,
    )


def sliding_layers(reader: GGUFFile, path: Path, num_layers: int, period: int) -> dict[str, Any]:
    """``sliding_window`` and ``layer_types`` from ``{arch}.attention.sliding_window`` and its pattern:
    a period ``p`` (the family's default when absent) makes layer ``i`` sliding unless ``i % p == p - 1``
    (every layer when ``p`` is 0), as llama.cpp reads it; an array gives one flag per layer."""
    arch = reader.fields.get("general.architecture")
    window = integer(reader, f"{arch}.attention.sliding_window", path, 0)
    if window <= 0:
        return {"sliding_window": None, "layer_types": ()}
    pattern = reader.fields.get(f"{arch}.attention.sliding_window_pattern", period)
    if isinstance(pattern, list):
        if len(pattern) != num_layers:
            raise ValueError(f"{arch}.attention.sliding_window_pattern in {path} lists {len(pattern)} layers "
                             f"for {num_layers}")
        flags = [bool(p) for p in pattern]
    else:
        p = int(pattern)
        flags = [p == 0 or i % p < p - 1 for i in range(num_layers)]
    if not any(flags):
        return {"sliding_window": None, "layer_types": ()}
    return {"sliding_window": window,
            "layer_types": tuple(SLIDING_ATTENTION if f else FULL_ATTENTION for f in flags)}


def expert_counts(reader: GGUFFile, path: Path, intermediate_size: int) -> dict[str, Any]:
    """``MoeConfig``'s ``num_experts``, ``top_k`` and ``intermediate_size`` (the dense one when the file
    states no ``expert_feed_forward_length``, as llama.cpp's Mixtral files do)."""
    arch = reader.fields.get("general.architecture")
    scale = number(reader, f"{arch}.expert_weights_scale", path)
    if scale not in (None, 0.0, 1.0):
        raise ValueError(f"unsupported {arch}.expert_weights_scale {scale} in {path}")
    return {"num_experts": integer(reader, f"{arch}.expert_count", path),
            "top_k": integer(reader, f"{arch}.expert_used_count", path),
            "intermediate_size": integer(reader, f"{arch}.expert_feed_forward_length", path,
                                         intermediate_size)}


def dense_layers(reader: GGUFFile, num_layers: int) -> tuple[int, ...]:
    """The layers of a mixture-of-experts file without a router (a dense MLP instead)."""
    names = {t.name for t in reader.tensors}
    return tuple(i for i in range(num_layers) if f"blk.{i}.ffn_gate_inp.weight" not in names)

"""Read a GGUF file: ``ModelConfig`` from its metadata, float32 weights under HF names.

The file is parsed by ``engine.gguf_file.GGUFFile`` (one fast pass over a memory
map). Quantized tensors are dequantized with ``gguf.quants.dequantize`` and reshaped to
the Hugging Face layout (GGUF lists dimensions innermost first). llama.cpp stores
the Q and K projections of ``llama``-arch models permuted for its interleaved
rope; ``unpermute_qk`` undoes that so the weights match the HF checkpoint.
Given a tensor-parallel ``TpShard``, a tensor split by rows is cut before it is
dequantized (GGUF rows are whole quantization blocks), one split by columns after.
"""

from __future__ import annotations

import functools
import math
import re
import stat
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from gguf.quants import dequantize

from engine.config import ModelConfig, RopeScaling
from engine.gguf_file import GGUFFile, GGUFTensor
from engine.tensor_parallel import TpShard, WeightSlice

GGUF_ARCHITECTURES = ("llama", "qwen2")

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_GLOBAL_RE = re.compile(r"(\w+)\.(weight|bias)")


def open_gguf(path: str | Path) -> GGUFFile:
    """Open ``path``, with clear errors for a missing or bad file.

    The parsed file is shared within the process (read-only: nothing may change its ``fields``) for as
    long as the file keeps its identity, size and modification time: a worker reads the config and then
    the weights from one parse (each parse cost 0.13-0.15 s of CPU before its string arrays were left
    undecoded, ``engine.gguf_file.StringArray``)."""
    path = Path(path)
    try:
        st = path.stat()
    except OSError:
        st = None
    if st is None or not stat.S_ISREG(st.st_mode):
        raise FileNotFoundError(f"GGUF file not found: {path}")
    return _open_gguf(str(path.resolve()), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=2)
def _open_gguf(path: str, dev: int, ino: int, size: int, mtime_ns: int) -> GGUFFile:
    try:
        return GGUFFile(path)
    except ValueError as exc:
        raise ValueError(f"cannot read GGUF file {path}: {exc}") from None


def hf_name(gguf_name: str) -> str | None:
    """Map a GGUF tensor name to its HF name; ``None`` for tensors HF has no slot for."""
    match = _LAYER_RE.fullmatch(gguf_name)
    if match:
        layer, part, kind = match.groups()
        target = _LAYER_NAMES.get(part)
        return f"model.layers.{layer}.{target}.{kind}" if target else None
    match = _GLOBAL_RE.fullmatch(gguf_name)
    if match and match.group(1) in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[match.group(1)]}.{match.group(2)}"
    return None


def unpermute_qk(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Invert llama.cpp's ``permute`` of a Q or K projection (rows grouped per head)."""
    rows = weight.shape[0]
    half = rows // num_heads // 2
    shaped = weight.reshape(num_heads, half, 2, *weight.shape[1:])
    return shaped.transpose(1, 2).reshape(weight.shape).contiguous()


def _field(reader: GGUFFile, key: str) -> object:
    return reader.fields.get(key)


def _number(reader: GGUFFile, key: str, path: Path) -> float:
    value = _field(reader, key)
    if not isinstance(value, (int, float)):
        raise ValueError(f"missing required metadata {key!r} in {path}")
    return value


def _tensor(reader: GGUFFile, name: str) -> GGUFTensor | None:
    return next((t for t in reader.tensors if t.name == name), None)


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


def _rope_scaling(reader: GGUFFile, arch: str, theta: float, head_dim: int,
                  path: Path) -> RopeScaling:
    kind = _field(reader, f"{arch}.rope.scaling.type") or "none"
    original = _field(reader, f"{arch}.rope.scaling.original_context_length")
    if kind == "linear":
        return RopeScaling(rope_type="linear",
                           factor=float(_number(reader, f"{arch}.rope.scaling.factor", path)))
    if kind != "none":
        raise ValueError(f"unsupported rope scaling type {kind!r} in {path}; supported: linear")
    rope_freqs = _tensor(reader, "rope_freqs.weight")
    if rope_freqs is None:
        return RopeScaling()
    stored = torch.from_numpy(np.asarray(rope_freqs.data, dtype=np.float64).reshape(-1))
    guess = RopeScaling(
        rope_type="llama3",
        factor=float(stored.max()),
        original_max_position_embeddings=int(original) if isinstance(original, int) else 8192,
    )
    expected = _llama3_factors(theta, head_dim, guess)
    if expected.shape != stored.shape or not torch.allclose(expected, stored, rtol=1e-4):
        raise ValueError(
            f"unsupported rope_freqs.weight in {path}: it does not match llama3 rope scaling "
            "with low_freq_factor=1, high_freq_factor=4; load the Hugging Face folder instead"
        )
    return guess


def _token_ids(reader: GGUFFile, *keys: str) -> tuple[int, ...]:
    ids: list[int] = []
    for key in keys:
        value = _field(reader, f"tokenizer.ggml.{key}")
        if isinstance(value, int) and value not in ids:
            ids.append(value)
    return tuple(ids)


def gguf_config(reader: GGUFFile, path: str | Path) -> ModelConfig:
    """Build a ``ModelConfig`` from an open reader's metadata and tensor list."""
    path = Path(path)
    arch = _field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"unsupported GGUF architecture {arch!r} in {path}; "
            f"supported: {', '.join(GGUF_ARCHITECTURES)}"
        )
    embed = _tensor(reader, "token_embd.weight")
    if embed is None:
        raise ValueError(f"missing tensor 'token_embd.weight' in {path}")
    hidden = int(_number(reader, f"{arch}.embedding_length", path))
    heads = int(_number(reader, f"{arch}.attention.head_count", path))
    key_length = _field(reader, f"{arch}.attention.key_length")
    head_dim = int(key_length) if isinstance(key_length, int) else hidden // heads
    freq_base = _field(reader, f"{arch}.rope.freq_base")
    theta = float(freq_base) if isinstance(freq_base, (int, float)) else 10000.0
    kv_heads = _field(reader, f"{arch}.attention.head_count_kv")
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    return ModelConfig(
        architecture=str(arch),
        vocab_size=int(embed.shape[-1]),
        hidden_size=hidden,
        intermediate_size=int(_number(reader, f"{arch}.feed_forward_length", path)),
        num_layers=int(_number(reader, f"{arch}.block_count", path)),
        num_heads=heads,
        num_kv_heads=int(kv_heads) if isinstance(kv_heads, int) else heads,
        head_dim=head_dim,
        rms_norm_eps=float(_number(reader, f"{arch}.attention.layer_norm_rms_epsilon", path)),
        rope_theta=theta,
        max_position_embeddings=int(_number(reader, f"{arch}.context_length", path)),
        tie_word_embeddings=_tensor(reader, "output.weight") is None,
        attention_bias=_tensor(reader, "blk.0.attn_q.bias") is not None,
        rope_scaling=_rope_scaling(reader, arch, theta, head_dim, path),
        bos_token_id=bos if isinstance(bos, int) else None,
        eos_token_ids=_token_ids(reader, "eos_token_id", "eot_token_id", "eom_token_id"),
        name=path.stem,
    )


def read_gguf_config(path: str | Path) -> ModelConfig:
    """Open ``path`` and read its ``ModelConfig``."""
    return gguf_config(open_gguf(path), path)


def _to_torch(tensor: GGUFTensor, cut: WeightSlice | None = None) -> torch.Tensor:
    hf_shape = [int(d) for d in reversed(tensor.shape)]
    data = tensor.data
    if cut is not None and cut.dim == 0:  # rows are whole quantization blocks: cut before dequantizing
        data = data[cut.start:cut.stop]
        hf_shape[0] = cut.stop - cut.start
    values = dequantize(data, tensor.tensor_type)
    values = np.require(values, dtype=np.float32, requirements=["C", "W"])
    weight = torch.from_numpy(values).reshape(hf_shape)
    return cut.take(weight) if cut is not None and cut.dim >= 1 else weight


def iter_gguf_weights(path: str | Path, config: ModelConfig | None = None,
                      shard: TpShard | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, float32 tensor)`` for each model tensor (``shard``'s slice of it when given),
    Q/K un-permuted for llama.

    The file is opened now; tensors are dequantized only as the iterator advances.
    """
    reader = open_gguf(path)
    return iter_tensors(reader, config or gguf_config(reader, path), shard)


def iter_tensors(reader: GGUFFile, config: ModelConfig,
                 shard: TpShard | None) -> Iterator[tuple[str, torch.Tensor]]:
    """``iter_gguf_weights`` over an open file."""
    for tensor in reader.tensors:
        name = hf_name(tensor.name)
        if name is None:
            continue
        cut = shard.weight_slice(name) if shard is not None and shard.size > 1 else None
        weight = _to_torch(tensor, cut)
        if config.architecture == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            # the permutation is within each head, so a slice of whole heads un-permutes on its own
            weight = unpermute_qk(weight, weight.shape[0] // config.head_dim)
        yield name, weight

"""Reading a Hugging Face ``config.json`` into ``ModelConfig``: the fields every family shares.

A family's module (``engine/models/<family>.py``) calls ``base_fields`` and adds what its own
architecture says (q/k norms, sliding layers, experts...). Only local files are read.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from engine.config import FULL_ATTENTION, SLIDING_ATTENTION, RopeScaling
from kernels.rope import ROPE_TYPES


def read_json(path: Path) -> dict[str, Any]:
    """Parse a JSON object from ``path`` with an error that names the file."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"invalid JSON in {path}: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"invalid JSON in {path}: expected an object, got {type(data).__name__}")
    return data


def required(raw: dict[str, Any], key: str, source: Path) -> int:
    if raw.get(key) is None:
        raise ValueError(f"missing required field {key!r} in {source}")
    return int(raw[key])


def rope_parameters(raw: dict[str, Any]) -> dict[str, Any]:
    """The rope parameters under either name (``rope_parameters`` or the older ``rope_scaling``)."""
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    return dict(params) if isinstance(params, dict) else {}


def parse_rope(params: dict[str, Any], theta: float, source: Path) -> tuple[float, RopeScaling]:
    """``(rope_theta, RopeScaling)`` from one set of rope parameters (``theta`` where they name none)."""
    theta = float(params.get("rope_theta", theta))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"unsupported rope scaling type {rope_type!r} in {source}; "
                         f"supported: {', '.join(ROPE_TYPES)}")
    if rope_type == "default":
        return theta, RopeScaling()
    base = RopeScaling()

    def num(key: str, default: float | None) -> float | None:
        value = params.get(key)
        return default if value is None else float(value)

    return theta, RopeScaling(
        rope_type=rope_type,
        factor=float(params.get("factor", base.factor)),
        low_freq_factor=float(params.get("low_freq_factor", base.low_freq_factor)),
        high_freq_factor=float(params.get("high_freq_factor", base.high_freq_factor)),
        original_max_position_embeddings=int(
            params.get("original_max_position_embeddings", base.original_max_position_embeddings)),
        beta_fast=num("beta_fast", base.beta_fast) or base.beta_fast,
        beta_slow=num("beta_slow", base.beta_slow) or base.beta_slow,
        mscale=num("mscale", None),
        mscale_all_dim=num("mscale_all_dim", None),
        attention_factor=num("attention_factor", None),
        truncate=bool(params.get("truncate", True)),
    )


def _as_ids(value: object) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    if isinstance(value, list):
        return tuple(int(v) for v in value)
    raise ValueError(f"bad eos_token_id {value!r}: expected an int or a list of ints")


def eos_ids(raw: dict[str, Any], folder: Path) -> tuple[int, ...]:
    """``eos_token_id`` of the config and of a ``generation_config.json`` beside it, in that order."""
    ids = list(_as_ids(raw.get("eos_token_id")))
    gen_path = folder / "generation_config.json"
    if gen_path.is_file():
        ids += [i for i in _as_ids(read_json(gen_path).get("eos_token_id")) if i not in ids]
    return tuple(ids)


def layer_types(raw: dict[str, Any], num_layers: int, sliding: list[bool] | None = None) -> tuple[str, ...]:
    """Per-layer attention kinds: the config's ``layer_types`` when it lists a sliding one, else
    ``sliding`` (a flag per layer) when one is set, else () (every layer full attention)."""
    listed = raw.get("layer_types")
    if isinstance(listed, list) and listed:  # every layer full attention reads as ()
        return tuple(str(t) for t in listed) if SLIDING_ATTENTION in listed else ()
    if sliding is not None and any(sliding):
        return tuple(SLIDING_ATTENTION if s else FULL_ATTENTION for s in sliding)
    return ()


def base_fields(raw: dict[str, Any], source: Path, architecture: str, max_positions: int) -> dict[str, Any]:
    """The ``ModelConfig`` fields every family reads the same way (``max_positions``: the family's
    default ``max_position_embeddings``)."""
    hidden = required(raw, "hidden_size", source)
    heads = required(raw, "num_attention_heads", source)
    theta, scaling = parse_rope(rope_parameters(raw), float(raw.get("rope_theta", 10000.0)), source)
    folder = source.parent
    return dict(
        architecture=architecture,
        vocab_size=required(raw, "vocab_size", source),
        hidden_size=hidden,
        intermediate_size=required(raw, "intermediate_size", source),
        num_layers=required(raw, "num_hidden_layers", source),
        num_heads=heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(raw.get("head_dim") or hidden // heads),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        max_position_embeddings=int(raw.get("max_position_embeddings") or max_positions),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=bool(raw.get("attention_bias", False)),
        rope_scaling=scaling,
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=eos_ids(raw, folder),
        name=folder.resolve().name if source.name == "config.json" else source.stem,
        checkpoint_dtype=_named_dtype(raw),
    )


def _named_dtype(raw: dict[str, Any]) -> str | None:
    """The dtype config.json names (``dtype`` in new transformers, ``torch_dtype`` before)."""
    value = raw.get("dtype") or raw.get("torch_dtype")
    return value if isinstance(value, str) else None

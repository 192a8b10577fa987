"""Read a local Hugging Face model folder: ``config.json`` and ``*.safetensors``.

Only local files are read; nothing here talks to a model hub. Weights come out
lazily, one ``(hf_name, tensor)`` pair at a time, in the dtype they are stored in
(callers cast). Tied embeddings are not repeated: a checkpoint without
``lm_head.weight`` yields none. Given a tensor-parallel ``TpShard``, each tensor is read
as the rank's slice only (``safe_open(...).get_slice``), not whole.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from engine.config import SUPPORTED_ARCHITECTURES, ModelConfig, RopeScaling
from engine.tensor_parallel import TpShard

HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}
_DEFAULT_MAX_POSITIONS = {"llama": 2048, "mistral": 131072, "qwen2": 32768}
_ROPE_TYPES = ("default", "linear", "llama3")


def read_json(path: Path) -> dict[str, Any]:
    """Parse a JSON object from ``path`` with an error that names the file."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"invalid JSON in {path}: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"invalid JSON in {path}: expected an object, got {type(data).__name__}")
    return data


def _check_folder(folder: Path) -> None:
    if not folder.exists():
        raise FileNotFoundError(f"model folder not found: {folder}")
    if not folder.is_dir():
        raise NotADirectoryError(f"not a model folder: {folder}")
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"no config.json in model folder {folder}")


def _architecture(raw: dict[str, Any], source: Path) -> str:
    archs = raw.get("architectures") or []
    for name in archs:
        if name in HF_ARCHITECTURES:
            return HF_ARCHITECTURES[name]
    model_type = raw.get("model_type")
    if not archs and model_type in SUPPORTED_ARCHITECTURES:
        return str(model_type)
    found = ", ".join(archs) if archs else f"model_type={model_type!r}"
    raise ValueError(
        f"unsupported architecture {found} in {source}; "
        f"supported: {', '.join(HF_ARCHITECTURES)}"
    )


def _rope(raw: dict[str, Any], source: Path) -> tuple[float, RopeScaling]:
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    theta = float(raw.get("rope_theta", params.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in _ROPE_TYPES:
        raise ValueError(
            f"unsupported rope scaling type {rope_type!r} in {source}; "
            f"supported: {', '.join(_ROPE_TYPES)}"
        )
    if rope_type == "default":
        return theta, RopeScaling()
    base = RopeScaling()
    return theta, RopeScaling(
        rope_type=rope_type,
        factor=float(params.get("factor", base.factor)),
        low_freq_factor=float(params.get("low_freq_factor", base.low_freq_factor)),
        high_freq_factor=float(params.get("high_freq_factor", base.high_freq_factor)),
        original_max_position_embeddings=int(
            params.get("original_max_position_embeddings", base.original_max_position_embeddings)
        ),
    )


def _as_ids(value: object) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    if isinstance(value, list):
        return tuple(int(v) for v in value)
    raise ValueError(f"bad eos_token_id {value!r}: expected an int or a list of ints")


def _eos_ids(raw: dict[str, Any], folder: Path) -> tuple[int, ...]:
    ids = list(_as_ids(raw.get("eos_token_id")))
    gen_path = folder / "generation_config.json"
    if gen_path.is_file():
        ids += [i for i in _as_ids(read_json(gen_path).get("eos_token_id")) if i not in ids]
    return tuple(ids)


def _sliding_window(raw: dict[str, Any], arch: str) -> int | None:
    window = raw.get("sliding_window")
    if window is None:
        return None
    if arch == "mistral" or (arch == "qwen2" and raw.get("use_sliding_window", False)):
        return int(window)
    return None


def _required(raw: dict[str, Any], key: str, source: Path) -> int:
    if raw.get(key) is None:
        raise ValueError(f"missing required field {key!r} in {source}")
    return int(raw[key])


def read_hf_config(folder: str | Path) -> ModelConfig:
    """Build a ``ModelConfig`` from ``folder/config.json`` (and generation_config.json)."""
    folder = Path(folder)
    _check_folder(folder)
    return read_hf_config_file(folder / "config.json")


def read_hf_config_file(source: str | Path) -> ModelConfig:
    """Build a ``ModelConfig`` from one ``config.json`` file (a generation_config.json beside it counts)."""
    source = Path(source)
    if not source.is_file():
        raise FileNotFoundError(f"config file not found: {source}")
    folder = source.parent
    raw = read_json(source)
    arch = _architecture(raw, source)
    hidden = _required(raw, "hidden_size", source)
    heads = _required(raw, "num_attention_heads", source)
    theta, scaling = _rope(raw, source)
    attention_bias = True if arch == "qwen2" else bool(raw.get("attention_bias", False))
    return ModelConfig(
        architecture=arch,
        vocab_size=_required(raw, "vocab_size", source),
        hidden_size=hidden,
        intermediate_size=_required(raw, "intermediate_size", source),
        num_layers=_required(raw, "num_hidden_layers", source),
        num_heads=heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(raw.get("head_dim") or hidden // heads),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        max_position_embeddings=int(
            raw.get("max_position_embeddings") or _DEFAULT_MAX_POSITIONS[arch]
        ),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=attention_bias,
        rope_scaling=scaling,
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=_eos_ids(raw, folder),
        sliding_window=_sliding_window(raw, arch),
        name=folder.resolve().name if source.name == "config.json" else source.stem,
    )


def safetensors_files(folder: str | Path) -> list[Path]:
    """The folder's weight files: those named by the index if there is one, else all."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"no weight_map in {index}")
        files = [folder / name for name in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{index} names missing files: {', '.join(missing)}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in model folder {folder}")
    return files


def iter_hf_weights(folder: str | Path, shard: TpShard | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, tensor)`` for every tensor in the folder's safetensors files (``shard``'s slice
    of each when given).

    The file list is checked now; tensors are read only as the iterator advances.
    """
    return iter_safetensors_files(safetensors_files(folder),
                                  shard if shard is not None and shard.size > 1 else None)


def iter_safetensors_files(files: list[Path], shard: TpShard | None) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of ``files`` in order, read lazily through a memory map (``shard``'s slice of each when
    given)."""
    for path in files:
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                cut = shard.weight_slice(name) if shard is not None else None
                if cut is None:
                    yield name, handle.get_tensor(name)
                elif cut.dim == 0:
                    yield name, handle.get_slice(name)[cut.start:cut.stop]
                else:
                    yield name, handle.get_slice(name)[:, cut.start:cut.stop]

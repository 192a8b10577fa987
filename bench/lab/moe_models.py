"""The random-weight models ``bench.lab.moe_step`` times: a Qwen3-MoE and two dense models of its size.

``Shape`` holds the sizes; ``hf_config(model, shape)`` is the Hugging Face ``config.json`` of one of
``MODELS``: ``qwen3_moe`` (every layer a mixture of ``experts`` experts of ``expert_intermediate``, top
``top_k`` of a softmax, renormalised), ``qwen3`` (the same attention, q/k norms included, with a dense MLP
of ``dense_intermediate``: by default ``top_k x expert_intermediate``, so a token reads as many parameters
as in the mixture, the router aside) and ``llama`` (that dense model without q/k norms, the layers the
engine's one-call native decoder computes). Embeddings are tied, so a decode step reads every weight but
the experts it is not routed to. ``qwen3_moe_fp8`` is ``qwen3_moe``'s checkpoint with its attention and
expert matrices stored as fp8 (e4m3) codes with one scale per output channel, as fp8 checkpoints ship
(``quantization_config``: fp8, ``weight_scale``); under ``--dtype auto`` the engine multiplies the codes.

``model_dir`` builds a model with transformers from its config (seeded, transformers' own random
initialisation), saves it with a word-level tokenizer (prompts are token ids anyway) under
``$PDSERVE_CACHE/bench/<model>-<hash of the config>`` and returns that folder; later calls find it there.
Nothing is fetched from a hub.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.loader import cache_root

MODELS = ("qwen3_moe", "qwen3", "llama", "qwen3_moe_fp8")
QUANTIZED = {"qwen3_moe_fp8": "qwen3_moe"}  # a quantized model -> the model whose weights it quantizes
FP8_MAX = 448.0
MAX_POSITIONS = 8192


@dataclass(frozen=True)
class Shape:
    hidden: int = 1024
    layers: int = 16
    heads: int = 16
    kv_heads: int = 4
    head_dim: int = 64
    experts: int = 24
    expert_intermediate: int = 256
    top_k: int = 4
    dense_intermediate: int = 0  # 0: top_k x expert_intermediate
    vocab: int = 32768

    @property
    def dense_mlp(self) -> int:
        return self.dense_intermediate or self.top_k * self.expert_intermediate


def hf_config(model: str, shape: Shape) -> dict[str, Any]:
    """The ``config.json`` fields of ``model`` (one of ``MODELS``) at ``shape``."""
    common: dict[str, Any] = dict(
        vocab_size=shape.vocab, hidden_size=shape.hidden, num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads, head_dim=shape.head_dim,
        intermediate_size=shape.dense_mlp, max_position_embeddings=MAX_POSITIONS, tie_word_embeddings=True,
        bos_token_id=None, eos_token_id=None, pad_token_id=None)
    if model == "qwen3_moe":
        return {**common, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
                "num_experts": shape.experts, "num_experts_per_tok": shape.top_k,
                "moe_intermediate_size": shape.expert_intermediate, "norm_topk_prob": True,
                "decoder_sparse_step": 1, "mlp_only_layers": []}
    if model == "qwen3":
        return {**common, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}
    if model == "llama":
        return {**common, "architectures": ["LlamaForCausalLM"], "model_type": "llama"}
    if model in QUANTIZED:
        return {**hf_config(QUANTIZED[model], shape), "quantization_config": {
            "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}}
    raise ValueError(f"unknown model {model!r}; choose from {', '.join(MODELS)}")


def model_dir(model: str, shape: Shape, seed: int = 0, root: Path | None = None) -> Path:
    """The folder of ``model`` at ``shape`` (under ``root``, default ``$PDSERVE_CACHE/bench``), built and
    saved on the first call."""
    fields = hf_config(model, shape)
    digest = hashlib.sha256(json.dumps([fields, seed], sort_keys=True).encode()).hexdigest()[:12]
    root = root or cache_root() / "bench"
    folder = root / f"{model}-{digest}"
    if (folder / "config.json").is_file():
        return folder
    base = model_dir(QUANTIZED[model], shape, seed, root) if model in QUANTIZED else None
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{model}-", dir=root))  # a crash leaves no half folder behind
    try:
        if base is not None:
            _write_fp8(base, staging, fields)
        else:
            _build(fields, seed).save_pretrained(str(staging), safe_serialization=True)
            _save_word_tokenizer(staging, shape.vocab)
        try:
            os.replace(staging, folder)
        except OSError:  # another process saved the same model first
            if not (folder / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder


def _write_fp8(base: Path, folder: Path, fields: dict[str, Any]) -> None:
    """``base``'s checkpoint into ``folder`` with every attention and expert matrix as e4m3 codes and a
    per-channel ``weight_scale`` (its row's largest magnitude / 448), the rest as saved."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(base / "model.safetensors"))
    for name in list(tensors):
        if name.endswith("_proj.weight") and (".experts." in name or ".self_attn." in name):
            w = tensors[name]
            scale = (w.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
            tensors[name] = (w / scale).to(torch.float8_e4m3fn)
            tensors[name.removesuffix("weight") + "weight_scale"] = scale.contiguous()
    save_file(tensors, str(folder / "model.safetensors"))
    for path in base.iterdir():
        if path.name not in ("model.safetensors", "config.json"):
            shutil.copy(path, folder / path.name)
    config = json.loads((base / "config.json").read_text())
    config["quantization_config"] = fields["quantization_config"]
    (folder / "config.json").write_text(json.dumps(config))


def _build(fields: dict[str, Any], seed: int) -> Any:
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    classes: dict[str, tuple[Any, Any]] = {"qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM),
                                           "qwen3": (Qwen3Config, Qwen3ForCausalLM),
                                           "llama": (LlamaConfig, LlamaForCausalLM)}
    config_class, model_class = classes[fields["model_type"]]
    kwargs = {k: v for k, v in fields.items() if k not in ("architectures", "model_type")}
    torch.manual_seed(seed)
    return model_class(config_class(**kwargs)).eval()


def _save_word_tokenizer(folder: Path, vocab: int) -> None:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    words = ["[UNK]"] + [f"w{i}" for i in range(1, vocab)]
    raw = Tokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    raw.pre_tokenizer = Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="[UNK]").save_pretrained(str(folder))

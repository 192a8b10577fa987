"""GGUF files of the tiny family models (``tests/families.py``), written as llama.cpp's
``convert_hf_to_gguf.py`` writes them, from the folder transformers saved.

Per family, what the converter does (its ``Qwen3Model``, ``Qwen3MoeModel``, ``LlamaModel`` for Mixtral,
``Gemma3Model``, ``GptOssModel`` and ``DeepseekV2Model`` for both DeepSeeks): the metadata its
``set_gguf_parameters`` writes, the tensors renamed by ``gguf``'s own name map
(``gguf.get_tensor_name_map``), experts stacked into 3-D ``*_exps`` tensors,
Mixtral's Q/K rows permuted (``LlamaModel.permute``), Gemma's norms stored as ``1 + w``, gpt-oss's fused
experts de-interleaved and transposed to ``[out, in]``, its sinks named ``attn_sinks.weight``,
DeepSeek's ``kv_b_proj`` split per head into ``attn_k_b`` (transposed) and ``attn_v_b``; and a
byte-level (``gpt2``) vocabulary of the folder's words. Matrices may be quantized with
``gguf.quants.quantize``, or ``tests/kquants.py`` for the K types (norms and biases stay float32, as the
converter keeps them).

Three things the converter would not write, because these tiny models differ there from every published
model of their family: the Qwen3-MoE model's dense first layer (``mlp_only_layers``) is written under
llama.cpp's dense names; Gemma's period of local layers (3 here, llama.cpp's default is 6) as
``gemma3.attention.sliding_window_pattern``; its ``query_pre_attn_scalar`` (24, not ``head_dim``) as
``gemma3.attention.scale``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType
from safetensors.torch import load_file

from bench.lab.kquants import quantize_any

ARCHITECTURES = {"qwen3": "qwen3", "qwen3_moe": "qwen3moe", "mixtral": "llama", "gemma3": "gemma3",
                 "gpt_oss": "gpt-oss", "deepseek_v2": "deepseek2", "deepseek_v3": "deepseek2"}
# and plain Llama (the layout of most GGUF files, and of the default model), written as its LlamaModel does
WRITTEN = {**ARCHITECTURES, "llama": "llama"}
MODEL_TYPES = {"llama": "llama", "qwen3": "qwen3", "qwen3_moe": "qwen3_moe", "mixtral": "mixtral",
               "gemma3_text": "gemma3",
               "gpt_oss": "gpt_oss", "deepseek_v2": "deepseek_v2", "deepseek_v3": "deepseek_v3"}


def write_gguf(folder: Path, path: Path, qtype: GGMLQuantizationType | None = None, only: str = "",
               kv_b_whole: bool = False, types: dict[str, GGMLQuantizationType] | None = None) -> Path:
    """Convert the HF folder ``folder`` into the GGUF file ``path``; with ``qtype``, every weight matrix
    (experts' stacks too) whose GGUF name contains ``only`` is stored quantized, in ``types[part]`` instead
    where the name contains ``part`` (the first such key), as llama.cpp's mixes (Q4_K_M) keep some
    tensors in another type. ``kv_b_whole``: DeepSeek's
    ``kv_b_proj`` as converters before the ``attn_k_b``/``attn_v_b`` split wrote it (with the per-head
    key and value widths as ``key_length``/``value_length``)."""
    config = json.loads((folder / "config.json").read_text())
    family = MODEL_TYPES[config["model_type"]]
    writer = gguf.GGUFWriter(str(path), WRITTEN[family])
    if family.startswith("deepseek"):
        _deepseek_metadata(writer, config, kv_b_whole)
    else:
        _metadata(writer, family, config)
    _vocabulary(writer, folder, config["vocab_size"])
    arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == WRITTEN[family])
    names = gguf.get_tensor_name_map(arch, config["num_hidden_layers"])
    dense = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config["num_hidden_layers"])
    for name, tensor in _converted(family, config, load_file(str(folder / "model.safetensors")), kv_b_whole):
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:  # the dense layer of the Qwen3-MoE model (see the module docstring)
            gguf_name = dense.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, name
        data = np.ascontiguousarray(tensor.float().numpy())
        chosen = next((t for part, t in (types or {}).items() if part in gguf_name), qtype)
        if chosen is not None and data.ndim > 1 and gguf_name.endswith(".weight") and only in gguf_name:
            quantized = quantize_any(data, chosen)
            writer.add_tensor(gguf_name, quantized, raw_shape=quantized.shape, raw_dtype=chosen)
        else:
            writer.add_tensor(gguf_name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _rope(writer: gguf.GGUFWriter, config: dict[str, Any]) -> None:
    """``TextModel.set_gguf_parameters``' rope keys: the full-attention layers' parameters."""
    params = config.get("rope_parameters") or {}
    full = params.get("full_attention", params)
    rope_type, factor = full.get("rope_type"), full.get("factor")
    if rope_type == "linear" and factor is not None:
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(factor)
    elif rope_type == "yarn" and factor is not None:
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(factor)
        writer.add_rope_scaling_orig_ctx_len(full["original_max_position_embeddings"])
        if full.get("beta_fast") is not None:
            writer.add_rope_scaling_yarn_beta_fast(full["beta_fast"])
        if full.get("beta_slow") is not None:
            writer.add_rope_scaling_yarn_beta_slow(full["beta_slow"])
    if full.get("rope_theta") is not None:
        writer.add_rope_freq_base(full["rope_theta"])
    local = params.get("sliding_attention", {}).get("rope_theta")
    if local is not None:
        writer.add_rope_freq_base_swa(local)


def _metadata(writer: gguf.GGUFWriter, family: str, config: dict[str, Any]) -> None:
    layers = config["num_hidden_layers"]
    writer.add_block_count(layers)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    _rope(writer, config)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    experts = config.get("num_local_experts") or config.get("num_experts")
    if experts is not None:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(config["num_experts_per_tok"])
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    if family in ("llama", "mixtral"):  # LlamaModel
        writer.add_vocab_size(config["vocab_size"])
        writer.add_rope_dimension_count(config["head_dim"])
    if family == "qwen3_moe":  # Qwen2MoeModel
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    if family == "gemma3":  # Gemma3Model
        if config.get("final_logit_softcapping"):
            writer.add_final_logit_softcapping(config["final_logit_softcapping"])
        writer.add_sliding_window(config["sliding_window"])
        kinds = config["layer_types"]
        period = kinds.index("full_attention") + 1
        assert kinds == [("full_attention" if (i + 1) % period == 0 else "sliding_attention")
                         for i in range(layers)]
        writer.add_sliding_window_pattern(period)
        writer.add_float32("gemma3.attention.scale", config["query_pre_attn_scalar"] ** -0.5)
    if family == "gpt_oss":  # GptOssModel
        writer.add_sliding_window(config["sliding_window"])
        writer.add_expert_feed_forward_length(config["intermediate_size"])


def _deepseek_metadata(writer: gguf.GGUFWriter, config: dict[str, Any], kv_b_whole: bool) -> None:
    """``DeepseekV2Model.set_gguf_parameters`` (on ``TextModel``'s): the latent as MQA of one KV head."""
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(1)
    _rope(writer, config)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_expert_count(config["n_routed_experts"])
    writer.add_expert_used_count(config["num_experts_per_tok"])
    if config.get("n_group") is not None:
        writer.add_expert_group_count(config["n_group"])
    if config.get("topk_group") is not None:
        writer.add_expert_group_used_count(config["topk_group"])
    if config.get("scoring_func") == "sigmoid":
        writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_leading_dense_block_count(config["first_k_dense_replace"])
    writer.add_vocab_size(config["vocab_size"])
    if config.get("q_lora_rank") is not None:
        writer.add_q_lora_rank(config["q_lora_rank"])
    rank, nope, rope = config["kv_lora_rank"], config["qk_nope_head_dim"], config["qk_rope_head_dim"]
    writer.add_kv_lora_rank(rank)
    if kv_b_whole:
        writer.add_key_length(nope + rope)
        writer.add_value_length(config["v_head_dim"])
    else:
        writer.add_key_length(rank + rope)
        writer.add_value_length(rank)
        writer.add_key_length_mla(nope + rope)
        writer.add_value_length_mla(config["v_head_dim"])
    writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    writer.add_expert_shared_count(config.get("n_shared_experts", 0))
    if config.get("routed_scaling_factor") is not None:
        writer.add_expert_weights_scale(config["routed_scaling_factor"])
    if config.get("norm_topk_prob"):
        writer.add_expert_weights_norm(True)
    writer.add_rope_dimension_count(rope)


def _vocabulary(writer: gguf.GGUFWriter, folder: Path, vocab_size: int) -> None:
    vocab = json.loads((folder / "tokenizer.json").read_text())["model"]["vocab"]
    tokens = [token for token, _ in sorted(vocab.items(), key=lambda item: item[1])]
    assert len(tokens) == vocab_size
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.NORMAL] * len(tokens))
    writer.add_token_scores([0.0] * len(tokens))  # a vocabulary of whole words: no merges to list


def _permute(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """``LlamaModel.permute``: each head's rows reordered for llama.cpp's interleaved rope."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(
        weight.shape)


def _stacked(tensors: dict[str, torch.Tensor], layers: int, experts: int, source: str,
             target: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Per-expert tensors ``source.format(layer, expert)`` stacked into ``target.format(layer)``."""
    for layer in range(layers):
        names = [source.format(layer, e) for e in range(experts)]
        if names[0] in tensors:
            yield target.format(layer), torch.stack([tensors.pop(n) for n in names])


def _converted(family: str, config: dict[str, Any], tensors: dict[str, torch.Tensor], kv_b_whole: bool
               ) -> Iterator[tuple[str, torch.Tensor]]:
    layers = config["num_hidden_layers"]
    experts = int(config.get("num_local_experts") or config.get("num_experts")
                  or config.get("n_routed_experts") or 0)
    if family.startswith("deepseek"):
        yield from _deepseek(config, tensors, experts, kv_b_whole)
        return
    if family == "qwen3_moe":
        for w in ("gate_proj", "up_proj", "down_proj"):
            yield from _stacked(tensors, layers, experts, "model.layers.{}.mlp.experts.{}." + w + ".weight",
                                "model.layers.{}.mlp.experts." + w + ".weight")
    if family == "mixtral":
        for w in ("w1", "w2", "w3"):
            yield from _stacked(tensors, layers, experts, "model.layers.{}.block_sparse_moe.experts.{}." + w
                                + ".weight", "layers.{}.feed_forward.experts." + w + ".weight")
    for name, tensor in tensors.items():
        if family in ("llama", "mixtral") and name.endswith("q_proj.weight"):
            tensor = _permute(tensor, config["num_attention_heads"])
        elif family in ("llama", "mixtral") and name.endswith("k_proj.weight"):
            tensor = _permute(tensor, config["num_key_value_heads"])
        elif family == "gemma3" and name.endswith("norm.weight"):
            tensor = tensor + 1
        elif family == "gpt_oss":
            yield from _gpt_oss(name, tensor)
            continue
        yield name, tensor


def _gpt_oss(name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """``GptOssModel.modify_tensors`` for float (not MXFP4) experts."""
    prefix = name.rsplit(".", 1)[0]
    if name.endswith("sinks"):
        yield name + ".weight", tensor
    elif name.endswith("experts.down_proj"):
        yield name + ".weight", tensor.transpose(-1, -2)
    elif name.endswith("experts.down_proj_bias"):
        yield name.replace("down_proj_bias", "down_proj.bias"), tensor
    elif name.endswith("experts.gate_up_proj"):
        fused = tensor.transpose(-1, -2)
        yield f"{prefix}.gate_proj.weight", fused[:, ::2, :]
        yield f"{prefix}.up_proj.weight", fused[:, 1::2, :]
    elif name.endswith("experts.gate_up_proj_bias"):
        yield f"{prefix}.gate_proj.bias", tensor[..., ::2]
        yield f"{prefix}.up_proj.bias", tensor[..., 1::2]
    else:
        yield name, tensor


def _deepseek(config: dict[str, Any], tensors: dict[str, torch.Tensor], experts: int,
              kv_b_whole: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """``DeepseekV2Model.modify_tensors``: experts stacked, ``kv_b_proj`` split per head into the key half
    (transposed) and the value half, the router's correction bias as a ``.bias``."""
    for w in ("gate_proj", "up_proj", "down_proj"):
        source = "model.layers.{}.mlp.experts.{}." + w + ".weight"
        yield from _stacked(tensors, config["num_hidden_layers"], experts, source,
                            "model.layers.{}.mlp.experts." + w + ".weight")
    heads, nope, v = config["num_attention_heads"], config["qk_nope_head_dim"], config["v_head_dim"]
    for name, tensor in tensors.items():
        if name.endswith("kv_b_proj.weight") and not kv_b_whole:
            k_b, v_b = tensor.view(heads, nope + v, tensor.shape[-1]).split([nope, v], dim=1)
            yield name.replace("kv_b_proj", "k_b_proj"), k_b.transpose(1, 2)
            yield name.replace("kv_b_proj", "v_b_proj"), v_b
        elif name.endswith("e_score_correction_bias"):
            yield name.replace("e_score_correction_bias", "e_score_correction.bias"), tensor
        else:
            yield name, tensor


def write_q4_k_m(root: Path) -> Path:
    """The wide tiny Llama (``tests.families``' ``llama_wide``, saved under ``root / "wide"``) as
    ``root / "Q4_K_M.gguf"``, mixed as llama.cpp's Q4_K_M mixes: Q4_K, with Q6_K for some layers' V (layer 0
    here: its fused QKV mixes the two kinds) and every layer's down projection; the embedding in Q6_K, the
    head in Q4_K."""
    from tests.families import save

    save("llama_wide", root / "wide")
    q6_k = GGMLQuantizationType.Q6_K
    return write_gguf(root / "wide", root / "Q4_K_M.gguf", GGMLQuantizationType.Q4_K,
                      types={"blk.0.attn_v": q6_k, "ffn_down": q6_k, "token_embd": q6_k})

"""GGUF files of every new family, written as llama.cpp's converter writes them (``tests/gguf_families.py``)
from the tiny models transformers saved (``tests/families.py``): the ``ModelConfig`` equals the one read
from the Hugging Face folder, the weights are the folder's, a tensor-parallel rank reads its slice of
them, quantized files dequantize as ``gguf`` dequantizes, and ``LLM`` over the GGUF gives transformers'
greedy tokens."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from transformers import PreTrainedModel

from engine import LLM, SamplingParams
from engine.config import FULL_ATTENTION, ModelConfig
from engine.gguf_loader import iter_gguf_weights, read_gguf_config
from engine.hf_loader import iter_hf_weights, read_hf_config
from engine.loader import load_model_source
from engine.models.registry import family
from engine.tensor_parallel import TpShard
from tests.families import MIN_MARGIN, clear_margin, hf_greedy, prompt, save
from tests.gguf_families import ARCHITECTURES, write_gguf

FAMILIES = tuple(ARCHITECTURES)  # the new families whose GGUF architecture llama.cpp defines
Q8, MXFP4 = GGMLQuantizationType.Q8_0, GGMLQuantizationType.MXFP4
# one quantized file per kind: every matrix of the Qwen3-MoE model in Q8_0, gpt-oss's experts in MXFP4,
# DeepSeek-V3's routed and shared experts in Q8_0 (its tiny attention's rows are shorter than a Q8_0 block)
QUANTIZED = {"qwen3_moe": (Q8, ""), "gpt_oss": (MXFP4, "_exps"), "deepseek_v3": (Q8, "exp")}
NEW_TOKENS = 8


@dataclasses.dataclass(frozen=True)
class Converted:
    folder: Path  # the Hugging Face folder transformers saved
    path: Path  # its GGUF, float32
    model: PreTrainedModel
    quantized: Path | None = None


@pytest.fixture(scope="module", autouse=True)
def own_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """This module's GGUF weight and tokenizer caches (``$PDSERVE_CACHE``), not the shared one."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PDSERVE_CACHE", str(tmp_path_factory.mktemp("cache")))
        yield


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Converted]:
    """Each family saved by transformers and converted once; the GGUF has the folder's name, so the two
    configs' ``name`` agree."""
    root = tmp_path_factory.mktemp("families")
    out: dict[str, Converted] = {}
    for name in FAMILIES:
        folder = root / "hf" / name
        model = save(name, folder)
        (root / "gguf").mkdir(exist_ok=True)
        path = write_gguf(folder, root / "gguf" / f"{name}.gguf")
        quantized = None
        if name in QUANTIZED:
            (root / "quantized").mkdir(exist_ok=True)
            quantized = write_gguf(folder, root / "quantized" / f"{name}.gguf", *QUANTIZED[name])
        out[name] = Converted(folder, path, model, quantized)
    return out


def _float32(value: Any) -> Any:
    """``value`` with every float rounded to float32, as GGUF metadata stores it (dataclasses too)."""
    if isinstance(value, float):
        return float(np.float32(value))
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.replace(value, **{f.name: _float32(getattr(value, f.name))
                                             for f in dataclasses.fields(value)})
    return value


def _comparable(config: ModelConfig) -> ModelConfig:
    """``config`` up to GGUF's float32 metadata, with "every layer full attention" spelled one way (a
    Hugging Face config may list the layer types even when none slides; GGUF has nothing to list), and
    without the checkpoint's dtype (a GGUF names one per tensor, not one for the model)."""
    if set(config.layer_types) == {FULL_ATTENTION}:
        config = dataclasses.replace(config, layer_types=())
    return _float32(dataclasses.replace(config, checkpoint_dtype=None))


@pytest.mark.parametrize("name", FAMILIES)
def test_config_equals_the_folders(converted: dict[str, Converted], name: str) -> None:
    ours = read_gguf_config(converted[name].path)
    assert ours.architecture == name
    assert _comparable(ours) == _comparable(read_hf_config(converted[name].folder))


def _hf_weights(folder: Path) -> dict[str, torch.Tensor]:
    config = read_hf_config(folder)
    weights = dict(family(config.architecture).canonical(iter_hf_weights(folder), config))
    if config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    return weights


@pytest.mark.parametrize("name", FAMILIES)
def test_weights_are_the_folders(converted: dict[str, Converted], name: str) -> None:
    """Every tensor under the layer library's name, bit for bit: Mixtral's Q/K un-permuted, experts one per
    name; Gemma's norms, stored as ``1 + w``, give the very ``1 + w`` its layers compute."""
    expected = _hf_weights(converted[name].folder)
    ours = dict(iter_gguf_weights(converted[name].path))
    assert ours.keys() == expected.keys()
    for key, tensor in ours.items():
        if name == "gemma3" and key.endswith("norm.weight"):
            assert torch.equal(1.0 + tensor, 1.0 + expected[key]), key
        else:
            assert torch.equal(tensor, expected[key]), key


@pytest.mark.parametrize("name", FAMILIES)
def test_a_rank_reads_its_slice(converted: dict[str, Converted], name: str) -> None:
    """At tensor parallelism 2 each rank's tensors are its slices of the whole ones (rows cut before
    dequantizing, in the quantized file too)."""
    files = [converted[name].path] + ([converted[name].quantized] if converted[name].quantized else [])
    for path in files:
        assert path is not None
        config = read_gguf_config(path)
        whole = dict(iter_gguf_weights(path, config))
        for rank in range(2):
            shard = TpShard(config, rank, 2)
            sliced = dict(iter_gguf_weights(path, config, shard))
            assert sliced.keys() == whole.keys()
            for key, tensor in sliced.items():
                cut = shard.weight_slice(key)
                assert torch.equal(tensor, whole[key] if cut is None else cut.take(whole[key])), (path, key)


def _through_gguf(tensor: torch.Tensor, qtype: GGMLQuantizationType) -> torch.Tensor:
    data = gguf.quants.quantize(tensor.numpy(), qtype)
    return torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(data, qtype), dtype=np.float32))


@pytest.mark.parametrize("name", list(QUANTIZED))
def test_quantized_files_dequantize_as_gguf_does(converted: dict[str, Converted], name: str) -> None:
    """The Q8_0 file's matrices (MXFP4: gpt-oss's experts) are the float32 file's through ``gguf``'s
    quantize and dequantize; everything else is unchanged."""
    qtype, only = QUANTIZED[name]
    path = converted[name].quantized
    assert path is not None
    plain = dict(iter_gguf_weights(converted[name].path))
    quantized = dict(iter_gguf_weights(path))
    changed = 0
    for key, tensor in quantized.items():
        expert = (".experts." in key or ".shared_experts." in key) and not key.endswith(".bias")
        if tensor.dim() > 1 and (expert or not only):
            assert torch.equal(tensor, _through_gguf(plain[key], qtype)), key
            assert not torch.equal(tensor, plain[key]), key
            changed += 1
        else:
            assert torch.equal(tensor, plain[key]), key
    config = read_gguf_config(path)
    assert config.moe is not None
    shared = 1 if config.moe.shared_intermediate_size else 0
    experts = 3 * (config.moe.num_experts + shared) * (config.num_layers - len(config.moe.dense_layers))
    assert changed == (experts if only else len([t for t in plain.values() if t.dim() > 1]))


@pytest.mark.parametrize("name", FAMILIES)
def test_greedy_from_gguf_equals_transformers(converted: dict[str, Converted], name: str) -> None:
    """``LLM`` over the GGUF file, prompts longer than the sliding windows, prefilled in chunks."""
    case = converted[name]
    batch = [prompt(5, seed=1), prompt(23, seed=2)]
    reference = [hf_greedy(case.model, ids, NEW_TOKENS) for ids in batch]
    for ids, generated in zip(batch, reference, strict=True):
        assert clear_margin(case.model, ids, generated) > MIN_MARGIN
    llm = LLM(model=str(case.path), dtype="float32", max_num_batched_tokens=16, num_threads=1,
              kv_cache_memory=1024**2)
    assert llm.engine.source.kind == "gguf" and llm.engine.model_config.architecture == name
    outputs = llm.generate(batch, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))
    assert [o.token_ids for o in outputs] == reference


def test_deepseek_files_from_before_the_kv_b_split(converted: dict[str, Converted], tmp_path: Path) -> None:
    """A ``deepseek2`` file with ``attn_kv_b`` whole and the head widths as ``key_length``/``value_length``
    (llama.cpp's converter before it split ``kv_b_proj``) reads as the split one does; a file missing one
    half of the split is refused by name."""
    case = converted["deepseek_v2"]
    whole = write_gguf(case.folder, tmp_path / "deepseek_v2.gguf", kv_b_whole=True)
    assert read_gguf_config(whole) == read_gguf_config(case.path)
    names = {t.name for t in gguf.GGUFReader(str(whole)).tensors}
    assert "blk.0.attn_kv_b.weight" in names and "blk.0.attn_k_b.weight" not in names
    ours, split = dict(iter_gguf_weights(whole)), dict(iter_gguf_weights(case.path))
    assert ours.keys() == split.keys()
    assert all(torch.equal(ours[k], split[k]) for k in ours)
    config = read_gguf_config(case.path)
    fmt = family(config.architecture).gguf
    assert fmt is not None
    halves = [("model.layers.1.self_attn.k_b_proj.weight", torch.zeros(4, 32, 16))]
    with pytest.raises(ValueError, match="only one of attn_k_b and attn_v_b for model.layers.1.self_attn"):
        dict(fmt.merge(iter(halves), config))


def _write_bare(path: Path, arch: str, tensors: dict[str, np.ndarray], **counts: int) -> Path:
    """A file of ``tensors`` (``uint8`` ones: raw Q8_1 rows) and little metadata beside ``counts``."""
    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in counts.items():
        writer.add_uint32(f"{arch}.{key}", value)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)
    for name, data in tensors.items():
        raw = GGMLQuantizationType.Q8_1 if data.dtype == np.uint8 else None
        writer.add_tensor(name, data, raw_shape=data.shape if raw else None, raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_unknown_architectures_and_tensors_are_clear_errors(tmp_path: Path) -> None:
    embed: dict[str, np.ndarray] = {"token_embd.weight": np.zeros((8, 4), np.float32)}
    sizes = dict(block_count=1, context_length=16, embedding_length=4, feed_forward_length=8,
                 **{"attention.head_count": 1})
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'glm4moe'") as info:
        load_model_source(_write_bare(tmp_path / "glm.gguf", "glm4moe", embed, **sizes))
    assert "supported: llama, qwen2, qwen3, qwen3moe, gemma3, gpt-oss, deepseek2" in str(info.value)
    with pytest.raises(ValueError, match="missing required metadata 'deepseek2.rope.dimension_count'"):
        load_model_source(_write_bare(tmp_path / "ds.gguf", "deepseek2", embed, **sizes))
    shared = {**embed, "blk.0.ffn_gate_shexp.weight": np.zeros((8, 4), np.float32)}
    with pytest.raises(ValueError, match="unsupported tensors .*blk.0.ffn_gate_shexp.weight"):
        load_model_source(_write_bare(tmp_path / "q.gguf", "qwen3moe", shared, **sizes, expert_count=2,
                                      expert_used_count=1))
    with pytest.raises(ValueError, match="missing required metadata 'qwen3moe.expert_count'"):
        load_model_source(_write_bare(tmp_path / "n.gguf", "qwen3moe", embed, **sizes))
    # a type gguf cannot dequantize (Q8_1: 40 bytes per 32 values) is named with its tensor
    q81 = {**embed, "blk.0.attn_q.weight": np.zeros((4, 40), np.uint8)}
    path = _write_bare(tmp_path / "q81.gguf", "qwen3", q81, **sizes)
    unsupported = r"tensor 'blk.0.attn_q.weight' is Q8_1, which gguf \S+ cannot dequantize"
    with pytest.raises(ValueError, match=unsupported):
        list(iter_gguf_weights(path))

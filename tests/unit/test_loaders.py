"""Model loaders against transformers: HF folders, GGUF files, tokenizers, errors."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from tokenizers import Tokenizer as RawTokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from engine.config import ModelConfig, RopeScaling
from engine.gguf_loader import unpermute_qk
from engine.loader import (
    DEFAULT_MODEL_FILE,
    default_model_path,
    load_model_source,
    resolve_model,
)
from engine.tokenizer import IncrementalDetokenizer, Tokenizer

TINY: dict[str, Any] = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|>"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant{% endif %}"
)
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
DEFAULT_GGUF = default_model_path()
needs_default_gguf = pytest.mark.skipif(
    not DEFAULT_GGUF.is_file(),
    reason=f"default model {DEFAULT_GGUF} absent (run scripts/setup.sh)",
)


def _save_tokenizer(folder: Path, chat_template: str | None = CHAT_TEMPLATE) -> None:
    words = ["[UNK]", "<s>", "</s>", "<|im_start|>", "<|im_end|>", "user", "assistant",
             "hello", "world"]
    raw = RawTokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    raw.pre_tokenizer = Whitespace()
    hf = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>",
                                 unk_token="[UNK]",
                                 additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    if chat_template is not None:
        hf.chat_template = chat_template
    hf.save_pretrained(str(folder))


def _save_model(folder: Path, model_cls: type[PreTrainedModel], config: PretrainedConfig,
                **save_kwargs: str) -> PreTrainedModel:
    torch.manual_seed(0)
    model = model_cls(config).eval()
    model.save_pretrained(str(folder), safe_serialization=True, **save_kwargs)
    return model


def _assert_config_matches(ours: ModelConfig, hf: PretrainedConfig) -> None:
    assert ours.vocab_size == hf.vocab_size
    assert ours.hidden_size == hf.hidden_size
    assert ours.intermediate_size == hf.intermediate_size
    assert ours.num_layers == hf.num_hidden_layers
    assert ours.num_heads == hf.num_attention_heads
    assert ours.num_kv_heads == hf.num_key_value_heads
    assert ours.head_dim == getattr(hf, "head_dim", hf.hidden_size // hf.num_attention_heads)
    assert ours.rms_norm_eps == pytest.approx(hf.rms_norm_eps)
    assert ours.rope_theta == pytest.approx(hf.rope_parameters["rope_theta"])
    assert ours.max_position_embeddings == hf.max_position_embeddings
    assert ours.tie_word_embeddings == hf.tie_word_embeddings
    assert ours.bos_token_id == hf.bos_token_id


def _assert_weights_equal(ours: Iterator[tuple[str, torch.Tensor]], model: PreTrainedModel,
                          tied: bool) -> None:
    expected = model.state_dict()
    seen = set()
    for name, tensor in ours:
        assert name in expected, name
        assert tensor.dtype == torch.float32, name
        assert torch.equal(tensor, expected[name]), name
        seen.add(name)
    assert seen == set(expected) - ({"lm_head.weight"} if tied else set())


HF_CASES = {
    "llama": (LlamaForCausalLM, LlamaConfig(**TINY, rope_parameters={
        "rope_type": "default", "rope_theta": 5e5}), {}),
    "llama3": (LlamaForCausalLM, LlamaConfig(**TINY, attention_bias=True, rope_parameters={
        "rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}), {}),
    "qwen2": (Qwen2ForCausalLM, Qwen2Config(**TINY, tie_word_embeddings=True,
                                            bos_token_id=1, eos_token_id=[2, 3]), {}),
    "mistral": (MistralForCausalLM, MistralConfig(**TINY, sliding_window=16), {}),
    "sharded": (LlamaForCausalLM, LlamaConfig(**TINY), {"max_shard_size": "20KB"}),
}


@pytest.fixture(scope="module", params=sorted(HF_CASES))
def hf_folder(request: pytest.FixtureRequest,
              tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path, PreTrainedModel]:
    model_cls, config, save_kwargs = HF_CASES[request.param]
    folder = tmp_path_factory.mktemp(request.param)
    model = _save_model(folder, model_cls, config, **save_kwargs)
    _save_tokenizer(folder)
    return request.param, folder, model


def test_hf_folder_config_and_weights(hf_folder: tuple[str, Path, PreTrainedModel]) -> None:
    case, folder, model = hf_folder
    source = load_model_source(folder)
    assert source.kind == "hf" and source.path == folder
    cfg = source.config
    _assert_config_matches(cfg, model.config)
    assert cfg.name == folder.name
    assert cfg.architecture == model.config.model_type
    assert cfg.attention_bias == (case in ("qwen2", "llama3"))
    assert cfg.sliding_window == (16 if case == "mistral" else None)
    assert cfg.eos_token_ids == ((2, 3) if case == "qwen2" else (2,))
    if case == "llama3":
        assert cfg.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 64)
    else:
        assert cfg.rope_scaling == RopeScaling()
    if case == "sharded":
        assert (folder / "model.safetensors.index.json").is_file()
        assert len(list(folder.glob("*.safetensors"))) > 1
    _assert_weights_equal(source.iter_weights(), model, cfg.tie_word_embeddings)


def test_hf_folder_tokenizer(hf_folder: tuple[str, Path, PreTrainedModel]) -> None:
    if hf_folder[0] == "qwen2":
        pytest.skip("transformers loads model_type qwen2 with Qwen2Tokenizer, which needs BPE")
    tok = load_model_source(hf_folder[1]).load_tokenizer()
    assert tok.encode("hello world") == [7, 8]
    assert tok.decode([1, 7, 8, 2]) == "hello world"
    assert tok.apply_chat_template([{"role": "user", "content": "hello"}]) == [3, 5, 7, 4, 3, 6]
    assert tok.apply_chat_template([{"role": "user", "content": "hello"}],
                                   add_generation_prompt=False) == [3, 5, 7, 4]
    assert tok.eos_token_ids[-1] == 2 and tok.bos_token_id == 1 and tok.vocab_size == 9


def test_generation_config_eos_and_rope_scaling_key(tmp_path: Path) -> None:
    _save_model(tmp_path, LlamaForCausalLM, LlamaConfig(**TINY))
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["rope_scaling"] = {"type": "linear", "factor": 2.0}
    raw.pop("rope_parameters", None)
    raw["rope_theta"] = 1234.0
    (tmp_path / "config.json").write_text(json.dumps(raw))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    cfg = load_model_source(tmp_path).config
    assert cfg.eos_token_ids == (2, 7)
    assert cfg.rope_theta == 1234.0
    assert cfg.rope_scaling == RopeScaling(rope_type="linear", factor=2.0)


def _write_config(folder: Path, **changes: object) -> Path:
    raw = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **TINY}
    raw.update(changes)
    for key in [k for k, v in raw.items() if v is None]:
        del raw[key]
    (folder / "config.json").write_text(json.dumps(raw))
    return folder


@pytest.mark.parametrize(("setup", "error", "fragment"), [
    (lambda p: p / "absent", FileNotFoundError, "model path not found"),
    (lambda p: p, FileNotFoundError, "no config.json"),
    (lambda p: (p / "w.bin").write_bytes(b"x") and p / "w.bin", ValueError,
     "unknown model file type"),
    (lambda p: (p / "config.json").write_text("{oops") and p, ValueError, "invalid JSON"),
    (lambda p: _write_config(p, architectures=["GPT2LMHeadModel"]), ValueError,
     "unsupported architecture GPT2LMHeadModel"),
    (lambda p: _write_config(p, hidden_size=None), ValueError,
     "missing required field 'hidden_size'"),
    (lambda p: _write_config(p, rope_scaling={"rope_type": "dynamic", "factor": 4.0}), ValueError,
     "unsupported rope scaling type 'dynamic'"),
    (lambda p: _write_config(p), FileNotFoundError, "no *.safetensors files"),
    (lambda p: (p / "bad.gguf").write_bytes(b"not a gguf file" * 8) and p / "bad.gguf",
     ValueError, "cannot read GGUF file"),
])
def test_load_errors(tmp_path: Path, setup: Callable[[Path], Path], error: type[Exception],
                     fragment: str) -> None:
    with pytest.raises(error) as info:
        load_model_source(setup(tmp_path))
    assert fragment in str(info.value)
    if "architecture" in fragment:
        assert "LlamaForCausalLM" in str(info.value) and "Qwen2ForCausalLM" in str(info.value)


def test_no_chat_template_is_a_clear_error(tmp_path: Path) -> None:
    _save_tokenizer(tmp_path, chat_template=None)
    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer.from_folder(tmp_path).apply_chat_template(FRANCE)


def test_resolve_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path))
    assert default_model_path() == tmp_path / "models" / DEFAULT_MODEL_FILE
    assert resolve_model("/some/folder") == Path("/some/folder")
    with pytest.raises(FileNotFoundError, match="scripts/setup.sh"):
        resolve_model(None)
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / DEFAULT_MODEL_FILE).write_bytes(b"")
    assert resolve_model(None) == tmp_path / "models" / DEFAULT_MODEL_FILE


def _llama_cpp_permute(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """convert_hf_to_gguf.py's ``LlamaModel.permute``."""
    return (weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def test_unpermute_inverts_llama_cpp_permute() -> None:
    weight = torch.randn(3 * 8, 5)
    assert torch.equal(unpermute_qk(_llama_cpp_permute(weight, 3), 3), weight)


def _write_gguf(path: Path, arch: str, model: PreTrainedModel, theta: float,
                rope_freqs: np.ndarray | None = None) -> None:
    cfg = model.config
    writer = gguf.GGUFWriter(str(path), arch)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], cfg.num_hidden_layers)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(theta)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads
            tensor = _llama_cpp_permute(tensor, heads)
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, name
        writer.add_tensor(gguf_name, tensor.numpy())
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", rope_freqs)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _llama3_rope_freqs(theta: float, dim: int, factor: float, original: int) -> np.ndarray:
    out = []
    for i in range(0, dim, 2):
        wavelen = 2 * math.pi * theta ** (i / dim)
        if wavelen < original / 4.0:
            out.append(1.0)
        elif wavelen > original / 1.0:
            out.append(factor)
        else:
            smooth = (original / wavelen - 1.0) / (4.0 - 1.0)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


@pytest.mark.parametrize("arch", ["llama", "llama3", "qwen2"])
def test_written_gguf_round_trip(tmp_path: Path, arch: str) -> None:
    if arch == "qwen2":
        model = _save_model(tmp_path, Qwen2ForCausalLM, Qwen2Config(**TINY))
    else:
        model = _save_model(tmp_path, LlamaForCausalLM, LlamaConfig(**TINY, tie_word_embeddings=True))
    freqs = _llama3_rope_freqs(5e5, 8, 32.0, 8192) if arch == "llama3" else None
    path = tmp_path / f"tiny-{arch}.gguf"
    _write_gguf(path, "qwen2" if arch == "qwen2" else "llama", model, 5e5, freqs)
    source = load_model_source(path)
    cfg = source.config
    assert (source.kind, cfg.name, cfg.eos_token_ids, cfg.rope_theta) == ("gguf", path.stem, (2,), 5e5)
    assert cfg.attention_bias == (arch == "qwen2")
    expected_rope = RopeScaling("llama3", factor=32.0) if arch == "llama3" else RopeScaling()
    assert cfg.rope_scaling == expected_rope
    _assert_weights_equal(source.iter_weights(), model, cfg.tie_word_embeddings)


@needs_default_gguf
def test_default_gguf_matches_transformers(transformers_default_model: PreTrainedModel) -> None:
    transformers_gguf_model = transformers_default_model
    source = load_model_source(DEFAULT_GGUF)
    cfg = source.config
    _assert_config_matches(cfg, transformers_gguf_model.config)
    assert cfg.eos_token_ids == (transformers_gguf_model.config.eos_token_id,)
    assert (cfg.architecture, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads) == ("llama", 30, 9, 3)
    _assert_weights_equal(source.iter_weights(), transformers_gguf_model, cfg.tie_word_embeddings)


@pytest.fixture(scope="module")
def gguf_tokenizers(tmp_path_factory: pytest.TempPathFactory) -> tuple[Tokenizer, Tokenizer]:
    """(converted from the GGUF now, reloaded from the tokenizer cache it wrote)."""
    if not DEFAULT_GGUF.is_file():
        pytest.skip(f"default model {DEFAULT_GGUF} absent (run scripts/setup.sh)")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PDSERVE_CACHE", str(tmp_path_factory.mktemp("cache")))
        source = load_model_source(DEFAULT_GGUF)
        return source.load_tokenizer(), source.load_tokenizer()


@needs_default_gguf
def test_gguf_tokenizer(gguf_tokenizers: tuple[Tokenizer, Tokenizer]) -> None:
    converted, cached = gguf_tokenizers
    expected_chat = converted.hf.apply_chat_template(FRANCE, add_generation_prompt=True,
                                                     tokenize=True, return_dict=False)
    text = "The capital of France is Paris. 日本語 😀!"
    for tok in (converted, cached):
        assert tok.eos_token_ids == (2,) and tok.bos_token_id == 1 and tok.vocab_size == 49152
        ids = tok.encode(text)
        assert ids == converted.hf.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text
        chat = tok.apply_chat_template(FRANCE)
        assert chat == list(expected_chat)
        assert chat[0] == 1 and tok.decode(chat[-4:], skip_special_tokens=False) == (
            "<|im_start|>assistant\n")


@needs_default_gguf
@pytest.mark.parametrize("skip_special", [True, False])
def test_incremental_detokenizer(gguf_tokenizers: tuple[Tokenizer, Tokenizer],
                                 skip_special: bool) -> None:
    tok = gguf_tokenizers[0]
    text = "Emoji 😀🎉👩‍💻, 中文字符和日本語のテキスト, Ünïcödé — done."
    ids = tok.apply_chat_template([{"role": "user", "content": text}]) + tok.encode(text) + [2]
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip_special)
    pieces = [detok.feed([i]) for i in ids]
    assert all("\ufffd" not in piece for piece in pieces)
    assert "" in pieces
    assert "".join(pieces) + detok.flush() == tok.decode(ids, skip_special_tokens=skip_special)


def test_incremental_detokenizer_flushes_an_incomplete_tail(
        gguf_tokenizers: tuple[Tokenizer, Tokenizer]) -> None:
    tok = gguf_tokenizers[0]
    ids = tok.encode("ok 😀")
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.feed(ids[:-1])]
    assert "\ufffd" not in pieces[0]
    assert pieces[0] + detok.flush() == tok.decode(ids[:-1])

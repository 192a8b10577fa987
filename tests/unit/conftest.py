"""Fixtures for engine unit tests: a tiny random Llama saved as a Hugging Face folder."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer as RawTokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from engine.tokenizer import Tokenizer

TINY_VOCAB = 256
UNIT_TIMEOUT_S = 120  # unit tests are CPU-only and short; the suite-wide limit (pyproject) is for Ray ones


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Give unit tests without a ``timeout`` mark of their own the tighter limit."""
    for item in items:
        if item.path.is_relative_to(Path(__file__).parent) and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(UNIT_TIMEOUT_S))


def save_word_tokenizer(folder: Path, vocab: int) -> None:
    """A word-level tokenizer over ``[UNK]``, ``w1`` ... ``w{vocab-1}`` saved into ``folder``."""
    words = ["[UNK]"] + [f"w{i}" for i in range(1, vocab)]
    raw = RawTokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    raw.pre_tokenizer = Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="[UNK]").save_pretrained(str(folder))


def perturb_weights(model: torch.nn.Module, seed: int, scale: float) -> None:
    """Add seeded noise of size ``scale`` to every weight (none when ``scale`` is 0): a model that mostly
    agrees with the original, for draft-model tests."""
    if not scale:
        return
    noise = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=noise) * scale)


def save_tiny_llama(folder: Path, seed: int = 0, vocab_size: int = TINY_VOCAB, perturb: float = 0.0) -> Path:
    """A seeded random 2-layer Llama (GQA, head_dim 16) with a word-level tokenizer, saved into ``folder``;
    ``perturb`` adds that much seeded noise to every weight (a model that mostly agrees with seed's)."""
    save_word_tokenizer(folder, vocab_size)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                         bos_token_id=None, eos_token_id=None, pad_token_id=None, initializer_range=0.2)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            if param.ndim == 1:
                param.add_(torch.randn_like(param) * 0.2)
    perturb_weights(model, seed + 1, perturb)
    model.save_pretrained(str(folder), safe_serialization=True)
    return folder


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``save_tiny_llama`` with seed 0 (vocab 256).

    Loads in well under a second, so engine tests can build several engines on it.
    Prompts are passed as token id lists; the model never emits EOS on its own (none is set).
    """
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def default_tokenizer() -> Tokenizer:
    """The built-in model's tokenizer (skips the test when the model was not fetched)."""
    from engine.loader import default_model_path, load_model_source

    path = default_model_path()
    if not path.is_file():
        pytest.skip("default model not fetched")
    return load_model_source(path).load_tokenizer()

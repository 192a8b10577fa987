"""``Tokenizer.from_folder`` loads a folder that names transformers' tokenizers backend with that class
directly (never importing ``AutoTokenizer``, whose import scans every model package), and the result is
the tokenizer ``AutoTokenizer`` gives; a folder naming another class still goes through ``AutoTokenizer``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from transformers import AutoTokenizer

from engine.loader import load_model_source
from engine.tokenizer import Tokenizer, _tokenizer_class

TEXTS = ["The capital of France is", "  leading spaces, ünïcode and <|im_end|> specials\n\ttabs", ""]


def _default_folder(default_model_path: Path) -> Path:
    from engine.loader import _tokenizer_cache_dir

    load_model_source(default_model_path).load_tokenizer()  # converts and caches the GGUF tokenizer once
    return _tokenizer_cache_dir(default_model_path)


def test_backend_folder_loads_the_same_tokenizer_as_auto(default_model_path: Path) -> None:
    folder = _default_folder(default_model_path)
    ours = Tokenizer.from_folder(folder).hf
    auto = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    assert type(ours) is type(auto)
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == auto.encode(text)
        assert ours.decode(ids) == auto.decode(ids)
    chat = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(chat, tokenize=False) == auto.apply_chat_template(chat, tokenize=False)
    assert ours.all_special_ids == auto.all_special_ids and ours.eos_token_id == auto.eos_token_id


def test_loading_the_default_tokenizer_never_imports_auto_tokenizer(default_model_path: Path) -> None:
    _default_folder(default_model_path)
    code = ("import sys; from engine.loader import load_model_source; "
            f"load_model_source({str(default_model_path)!r}).load_tokenizer(); "
            "print('transformers.models.auto.tokenization_auto' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         check=True)
    assert out.stdout.strip() == "False", out.stderr


def test_other_classes_go_through_auto_tokenizer(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text("{}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "LlamaTokenizer"}))
    assert _tokenizer_class(tmp_path) is AutoTokenizer
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "TokenizersBackend"}))
    assert _tokenizer_class(tmp_path).__name__ == "TokenizersBackend"
    (tmp_path / "tokenizer.json").unlink()  # the backend needs tokenizer.json: else AutoTokenizer decides
    assert _tokenizer_class(tmp_path) is AutoTokenizer
    (tmp_path / "tokenizer_config.json").write_text("not json")
    assert _tokenizer_class(tmp_path) is AutoTokenizer

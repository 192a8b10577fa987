"""Tokenization and chat templates, from a local HF folder or a GGUF file's metadata.

Everything is read from local files (``local_files_only=True``, hub offline).
``decode`` never applies ``clean_up_tokenization_spaces`` so that decoding a
sequence piecewise (``IncrementalDetokenizer``) and all at once agree.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from tokenizers import Tokenizer as RustTokenizer  # noqa: E402
from tokenizers.decoders import DecodeStream  # noqa: E402
from transformers import PreTrainedTokenizerBase  # noqa: E402

# tokenizer_config.json classes that are transformers' tokenizers-library backend itself: loaded by that
# class directly, since importing ``AutoTokenizer`` scans every model package transformers has (about
# 2 s of CPU in every worker and router process); any other class goes through ``AutoTokenizer``
_BACKEND_CLASSES = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})


def _tokenizer_class(folder: Path) -> type[PreTrainedTokenizerBase]:
    """The class that loads ``folder``: the tokenizers backend for a folder that names it (the converted
    GGUF tokenizers cached by ``from_gguf`` do), else ``AutoTokenizer``."""
    try:
        named = json.loads((folder / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        named = None
    if named in _BACKEND_CLASSES and (folder / "tokenizer.json").is_file():
        from transformers.tokenization_utils_tokenizers import TokenizersBackend

        return TokenizersBackend
    from transformers import AutoTokenizer

    return AutoTokenizer  # type: ignore[return-value]  # its from_pretrained answers an instance

_REPLACEMENT_CHAR = "\ufffd"
_INVALID_PREFIX = "Invalid prefix"  # DecodeStream's error when new ids change text it already gave out


def _save_atomically(hf: PreTrainedTokenizerBase, folder: Path) -> None:
    """Save to a temporary sibling, then rename; a cache that cannot be written is skipped."""
    partial = folder.with_name(f"{folder.name}.tmp{os.getpid()}")
    try:
        hf.save_pretrained(str(partial))
        partial.rename(folder)
    except OSError:
        shutil.rmtree(partial, ignore_errors=True)


class Tokenizer:
    """A Hugging Face tokenizer with the small surface the engine and router use."""

    def __init__(self, hf_tokenizer: PreTrainedTokenizerBase,
                 eos_token_ids: Sequence[int] = ()) -> None:
        self.hf = hf_tokenizer
        ids = list(eos_token_ids)
        own_eos = hf_tokenizer.eos_token_id
        if isinstance(own_eos, int) and own_eos not in ids:
            ids.append(own_eos)
        self.eos_token_ids: tuple[int, ...] = tuple(ids)

    @classmethod
    def from_folder(cls, folder: str | Path, eos_token_ids: Sequence[int] = ()) -> Tokenizer:
        """Load the tokenizer files saved in a local HF model folder."""
        folder = Path(folder)
        try:
            hf = _tokenizer_class(folder).from_pretrained(str(folder), local_files_only=True)
        except (OSError, ValueError) as exc:
            raise ValueError(f"cannot load a tokenizer from {folder}: {exc}") from None
        return cls(hf, eos_token_ids)

    @classmethod
    def from_gguf(cls, path: str | Path, eos_token_ids: Sequence[int] = (),
                  cache_dir: Path | None = None) -> Tokenizer:
        """Build the tokenizer stored in a GGUF file's metadata.

        Converting it takes seconds; with ``cache_dir`` the converted tokenizer is
        saved there once and later loads read that folder instead. The tokenizers backend
        converts it from the tokenizer metadata alone: ``AutoTokenizer`` would first parse
        the model config out of the file, which transformers fails to do for gpt-oss files
        (their YaRN keys).
        """
        path = Path(path)
        if cache_dir is not None and (cache_dir / "tokenizer_config.json").is_file():
            return cls.from_folder(cache_dir, eos_token_ids)
        from transformers.tokenization_utils_tokenizers import TokenizersBackend

        hf = TokenizersBackend.from_pretrained(
            str(path.parent), gguf_file=path.name, local_files_only=True
        )
        if cache_dir is not None:
            _save_atomically(hf, cache_dir)
        return cls(hf, eos_token_ids)

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included."""
        return len(self.hf)

    @property
    def bos_token_id(self) -> int | None:
        bos = self.hf.bos_token_id
        return bos if isinstance(bos, int) else None

    @property
    def has_chat_template(self) -> bool:
        return bool(self.hf.chat_template)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        text = self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens,
                              clean_up_tokenization_spaces=False)
        return str(text)

    @property
    def template_has_tools(self) -> bool:
        """Whether the chat template renders tool definitions itself (it reads a ``tools`` variable)."""
        return "tools" in str(self.hf.chat_template or "")

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    tools: list[dict[str, Any]] | None = None) -> str:
        """The chat template applied to ``messages`` (and ``tools``, for a template that reads them), as
        text."""
        if not self.has_chat_template:
            raise ValueError(
                "this model has no chat template; use the completions API with a plain prompt"
            )
        text = self.hf.apply_chat_template(
            messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False  # type: ignore[arg-type]
        )
        return str(text)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None) -> list[int]:
        """Token ids of the rendered chat; the template supplies any special tokens."""
        return self.encode(self.render_chat(messages, add_generation_prompt, tools))


def _stream_backend(tokenizer: Tokenizer) -> RustTokenizer | None:
    """The tokenizers-library tokenizer that ``tokenizer.decode`` hands the ids to unchanged, so that a
    ``DecodeStream`` over it gives that decode's text; None where the text comes another way (a
    ``Tokenizer`` subclass decoding its own way, a slow Python tokenizer, a transformers class overriding
    its backend's decode)."""
    if type(tokenizer).decode is not Tokenizer.decode:
        return None
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    hf = tokenizer.hf
    if not isinstance(hf, TokenizersBackend) or type(hf).decode is not PreTrainedTokenizerBase.decode \
            or type(hf)._decode is not TokenizersBackend._decode:
        return None
    backend: RustTokenizer = hf.backend_tokenizer
    return backend


class IncrementalDetokenizer:
    """Turns a request's token stream into text pieces as characters complete.

    ``feed`` returns only text that is final: a character whose UTF-8 bytes are
    split across tokens is held back until its last byte arrives, so no U+FFFD is
    emitted mid-character. ``"".join(pieces) + flush()`` equals
    ``tokenizer.decode(all_ids)``; ``flush`` ends the stream.

    The pieces are the tokenizers library's ``DecodeStream``'s where it decodes as
    ``Tokenizer.decode`` does (``_stream_backend``): the same window over the ids as
    below, run in Rust. The window is kept here too, in Python (``_pending``), for
    what ``DecodeStream`` does not do: ``flush`` (it has no way to give up the held
    bytes), tokenizers it cannot stand in for, and a stream it refuses to go on with
    (it raises "invalid prefix" when decoding more ids changes text already given
    out, as a byte-fallback tokenizer does after bytes that are no valid UTF-8):
    from that token on the window here goes on, as it always has.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._ids: list[int] = []
        self._prefix_offset = 0  # ids before this one only give the window its context
        self._read_offset = 0  # the text of the ids before this one was given out
        self._backend = _stream_backend(tokenizer)
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens) if self._backend else None

    @property
    def token_ids(self) -> list[int]:
        return list(self._ids)

    def _pending(self) -> str:
        prefix = self._tokenizer.decode(
            self._ids[self._prefix_offset:self._read_offset], self._skip_special
        )
        window = self._tokenizer.decode(self._ids[self._prefix_offset:], self._skip_special)
        return window[len(prefix):]

    def _advance(self) -> None:
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)

    def _step(self, new_ids: Sequence[int]) -> str:
        if self._stream is not None and self._backend is not None:
            try:
                return self._stream.step(self._backend, list(new_ids)) or ""
            except Exception as exc:  # the library raises a bare Exception
                if not str(exc).startswith(_INVALID_PREFIX):
                    raise
                self._stream = None
        piece = self._pending()
        return "" if piece.endswith(_REPLACEMENT_CHAR) else piece

    def feed(self, new_ids: Sequence[int]) -> str:
        """Add token ids; return the text they completed (possibly empty)."""
        self._ids.extend(new_ids)
        if self._read_offset == len(self._ids):
            return ""
        piece = self._step(new_ids)
        if piece:
            self._advance()
        return piece

    def flush(self) -> str:
        """Return whatever is held back (at the end of a request), even if incomplete."""
        self._stream = None
        if self._read_offset == len(self._ids):
            return ""
        piece = self._pending()
        self._advance()
        return piece

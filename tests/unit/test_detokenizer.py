"""Incremental detokenization (``engine/tokenizer.py:IncrementalDetokenizer``): the tokenizers library's
``DecodeStream`` where it stands in for ``Tokenizer.decode``, the Python window where it cannot.

The window (a ``Tokenizer`` whose ``decode`` is its own, so no stream stands in for it) is the reference:
on the default model's byte-level BPE, a byte-fallback tokenizer (multi-byte characters as byte tokens)
and a word-level one, with special and added tokens, skipped or not, the stream gives the same pieces,
token by token and in batches; the pieces never split a character and add up to the whole decode. Where
the stream refuses (ids that change text already given out: bytes that are no valid UTF-8 under byte
fallback), the window goes on from that token.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence

from tokenizers import Tokenizer as RustTokenizer
from tokenizers import decoders, normalizers, pre_tokenizers
from tokenizers.models import BPE, WordLevel
from tokenizers.trainers import BpeTrainer
from transformers import PreTrainedTokenizerFast

from engine.tokenizer import IncrementalDetokenizer, Tokenizer, _stream_backend

TEXTS = ["The lighthouse keeper counted the ships.", "Emoji 😀🎉👩‍💻, 中文字符和日本語 — Ünïcödé, done.",
         " leading space and trailing\n", "ok 😀"]


class WindowTokenizer(Tokenizer):
    """The same tokenizer, decoding through an override: the detokenizer uses its Python window."""

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return super().decode(ids, skip_special_tokens)


def byte_fallback() -> Tokenizer:
    """A Llama-2-style tokenizer: BPE over a tiny alphabet, every other character as byte tokens, a
    Metaspace-like normalizer and the Replace / ByteFallback / Fuse / Strip decoder, an added token."""
    raw = RustTokenizer(BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    raw.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    raw.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    trainer = BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>", *byte_tokens],
                         limit_alphabet=40, show_progress=False)
    raw.train_from_iterator(["the lighthouse keeper counted the ships that passed each night"] * 5, trainer)
    saved = json.loads(raw.to_str())  # the byte tokens: plain vocabulary, as in Llama 2's, not special
    saved["added_tokens"] = [t for t in saved["added_tokens"] if t["content"] not in byte_tokens]
    raw = RustTokenizer.from_str(json.dumps(saved))
    hf = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    hf.add_tokens(["<tool>"])
    return Tokenizer(hf)


def word_level() -> Tokenizer:
    words = ["[UNK]", "<s>", *(f"w{i}" for i in range(2, 40))]
    raw = RustTokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    return Tokenizer(PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="[UNK]", bos_token="<s>"))


def pieces(tokenizer: Tokenizer, ids: list[int], skip: bool, batch: int = 1) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip)
    out = [detok.feed(ids[i:i + batch]) for i in range(0, len(ids), batch)]
    return [*out, detok.flush()]


def window_of(tokenizer: Tokenizer) -> WindowTokenizer:
    return WindowTokenizer(tokenizer.hf, tokenizer.eos_token_ids)


def cases(tokenizer: Tokenizer) -> list[list[int]]:
    found = [tokenizer.encode(t) for t in TEXTS]
    eos = list(tokenizer.eos_token_ids[:1])
    found += [[*tokenizer.encode(TEXTS[1]), *eos, *tokenizer.encode(TEXTS[0])]]  # a special token inside
    if tokenizer.has_chat_template:
        found.append(tokenizer.apply_chat_template([{"role": "user", "content": TEXTS[1]}]) + eos)
    return found


def check_like_the_window(tokenizer: Tokenizer) -> None:
    assert _stream_backend(tokenizer) is not None and _stream_backend(window_of(tokenizer)) is None
    for ids in cases(tokenizer):
        for skip in (True, False):
            for batch in (1, 3):
                got = pieces(tokenizer, ids, skip, batch)
                assert got == pieces(window_of(tokenizer), ids, skip, batch), (ids, skip, batch)
                assert "".join(got) == tokenizer.decode(ids, skip)
                assert all("\ufffd" not in piece for piece in got[:-1])


def test_the_default_models_tokenizer_streams_as_the_window_does(default_tokenizer: Tokenizer) -> None:
    check_like_the_window(default_tokenizer)
    ids = default_tokenizer.encode("ok 😀")
    detok = IncrementalDetokenizer(default_tokenizer)
    assert detok.feed(ids[:-1]) == ""  # the emoji's last byte is missing: nothing final yet
    assert detok.flush() == default_tokenizer.decode(ids[:-1])  # the held text, incomplete as it is


def test_a_byte_fallback_tokenizer_streams_as_the_window_does() -> None:
    tokenizer = byte_fallback()
    tokens = tokenizer.hf.convert_ids_to_tokens(tokenizer.encode(TEXTS[1]))
    assert "<0xF0>" in tokens and tokenizer.decode(tokenizer.encode(TEXTS[1])) == TEXTS[1]
    check_like_the_window(tokenizer)


def test_a_word_level_tokenizer_streams_as_the_window_does() -> None:
    check_like_the_window(word_level())


def test_random_ids_stream_as_the_window_does(default_tokenizer: Tokenizer) -> None:
    """Any ids a model may sample, bytes that are no valid UTF-8 included; under byte fallback such
    bytes make ``DecodeStream`` refuse, and the window goes on from that token."""
    rng = random.Random(0)
    refused = 0
    for tokenizer in (default_tokenizer, byte_fallback()):
        window = window_of(tokenizer)
        for _ in range(200):
            ids = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randint(1, 20))]
            detok = IncrementalDetokenizer(tokenizer)
            got = [detok.feed([i]) for i in ids]
            refused += detok._stream is None
            assert got == pieces(window, ids, True)[:-1], ids
    assert refused > 0  # the fallback ran


def test_tokenizers_the_stream_cannot_stand_in_for_use_the_window() -> None:
    tokenizer = byte_fallback()
    assert _stream_backend(tokenizer) is tokenizer.hf.backend_tokenizer
    assert _stream_backend(window_of(tokenizer)) is None  # decodes its own way

    class OwnDecode(PreTrainedTokenizerFast):
        def _decode(self, *args: object, **kwargs: object) -> str:
            return str(super()._decode(*args, **kwargs)).upper()  # type: ignore[arg-type]

    own = Tokenizer(OwnDecode(tokenizer_object=tokenizer.hf.backend_tokenizer, unk_token="<unk>"))
    assert _stream_backend(own) is None
    ids = own.encode("the keeper")
    assert "".join(pieces(own, ids, True)) == own.decode(ids) == "THE KEEPER"

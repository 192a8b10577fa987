"""A tokenizer as llguidance reads it when it cannot convert the tokenizer itself (``engine/structured.py``
imports this where it first compiles a grammar, so an engine serving none never loads llguidance)."""

from __future__ import annotations

from collections.abc import Sequence

import llguidance

from engine.tokenizer import Tokenizer


class TokenBytes(llguidance.TokenizerWrapper):
    """Each token's bytes taken from decoding it alone (for tokenizers llguidance cannot convert);
    text is tokenized by greedy longest match over those bytes."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self.eos_token_id = eos_token_ids[0] if eos_token_ids else 0
        self.bos_token_id = tokenizer.bos_token_id
        self.tokens = [tokenizer.decode([i], skip_special_tokens=False).encode() for i in range(vocab_size)]
        self.special_token_ids = []
        self.is_tokenizer_wrapper = True
        self._ids = {b: i for i, b in reversed(list(enumerate(self.tokens))) if b}
        self._longest = max(map(len, self._ids), default=1)

    def __call__(self, text: str | bytes) -> list[int]:
        data = text.encode() if isinstance(text, str) else text
        out, at = [], 0
        while at < len(data):
            for size in range(min(self._longest, len(data) - at), 0, -1):
                token = self._ids.get(data[at:at + size])
                if token is not None:
                    out.append(token)
                    at += size
                    break
            else:
                at += 1  # a byte no token spells: skipped
        return out

"""vLLM's ``/tokenize`` and ``/detokenize`` bodies.

``POST /tokenize``: ``{"model", "prompt", "add_special_tokens"}`` or ``{"model", "messages",
"add_generation_prompt"}`` (the chat template applied, as ``/v1/chat/completions`` would) ->
``{"count", "max_model_len", "tokens"}``. ``POST /detokenize``: ``{"model", "tokens"}`` -> ``{"prompt"}``.
Unknown fields are refused (400 naming them), as on the generation endpoints.
"""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta

from router.protocol import ChatMessage


class TokenizeRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    model: str
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    model: str
    tokens: list[Annotated[int, Meta(ge=0)]]

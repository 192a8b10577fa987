"""vLLM's ``/tokenize`` and ``/detokenize``: their bodies and routes (``add_tokenize_routes``).

``POST /tokenize``: ``{"model", "prompt", "add_special_tokens"}`` or ``{"model", "messages",
"add_generation_prompt"}`` (the chat template applied, as ``/v1/chat/completions`` would) ->
``{"count", "max_model_len", "tokens"}``. ``POST /detokenize``: ``{"model", "tokens"}`` -> ``{"prompt"}``.
Unknown fields are refused (400 naming them), as on the generation endpoints.
"""

from __future__ import annotations

import asyncio
from typing import Annotated

import msgspec
from fastapi import FastAPI, Request
from msgspec import Meta
from starlette.responses import Response

from engine.tokenizer import Tokenizer
from router.config import RouterConfig
from router.errors import invalid, model_not_found
from router.http import read_body
from router.protocol import ChatMessage, decode_body


class TokenizeRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    model: str
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    model: str
    tokens: list[Annotated[int, Meta(ge=0)]]


def add_tokenize_routes(app: FastAPI, tokenizer: Tokenizer, config: RouterConfig) -> None:
    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        req = decode_body(await read_body(request, config.max_request_bytes), TokenizeRequest)
        if req.model != config.model_name:
            raise model_not_found(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise invalid("Give exactly one of 'prompt' and 'messages'.", "prompt")
        if req.messages is not None:
            convo = [{"role": m.role, "content": m.text()} for m in req.messages]
            try:
                ids = await asyncio.to_thread(tokenizer.apply_chat_template, convo, req.add_generation_prompt)
            except Exception as exc:
                raise invalid(f"Cannot apply the chat template: {exc}", "messages") from None
        else:
            assert req.prompt is not None
            ids = await asyncio.to_thread(tokenizer.encode, req.prompt, req.add_special_tokens)
        body = {"count": len(ids), "max_model_len": config.max_model_len, "tokens": ids}
        return Response(msgspec.json.encode(body), media_type="application/json")

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        req = decode_body(await read_body(request, config.max_request_bytes), DetokenizeRequest)
        if req.model != config.model_name:
            raise model_not_found(req.model)
        if any(t >= tokenizer.vocab_size for t in req.tokens):
            raise invalid(f"'tokens' must be token ids in [0, {tokenizer.vocab_size}).", "tokens")
        text = tokenizer.decode(req.tokens)
        return Response(msgspec.json.encode({"prompt": text}), media_type="application/json")

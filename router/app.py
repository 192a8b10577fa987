"""The OpenAI-compatible HTTP app: ``create_app(client, tokenizer, config)``, its routes.

Order of checks for a generation request: API key (401), body size (413),
JSON and parameter validation (400), model name (404), readiness (503),
tokenization and length against ``max_model_len`` (400), admission (503 +
Retry-After), then generation under ``request_timeout`` (408, the requests
aborted). A streaming response starts only once the first token has arrived, so
failures before it still get their status code; a failure after it ends the
stream with an ``error`` event and ``data: [DONE]``. A client that disconnects
has its requests aborted (``router.generation``). The routes of other modules:
``/tokenize`` and ``/detokenize`` (``router.tokenize``), ``GET /v1/workers`` and
the drain and add endpoints (``router.admin``), ``GET /v1/prefix_index``
(``router.debug``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence

from fastapi import FastAPI, Request
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.responses import Response

from engine.grammar import GrammarError, check
from engine.sampling_params import StructuredOutput
from engine.tokenizer import Tokenizer
from router.admin import WORKER_STATS_TIMEOUT, add_admin_routes
from router.client import PDClient
from router.config import RouterConfig
from router.debug import add_debug_routes
from router.errors import RequestFailed, install_handlers, invalid, unavailable
from router.generation import Generation
from router.http import Gatekeeper
from router.metrics import worker_metrics
from router.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    Prompt,
    completion_prompts,
    openapi_components,
)
from router.responses import Json
from router.structured import structured_of
from router.tokenize import add_tokenize_routes
from router.tools import conversation, mode_of
from telemetry.tracing import Tracing


def create_app(client: PDClient, tokenizer: Tokenizer, config: RouterConfig,
               tracing: Tracing | None = None, registries: Sequence[CollectorRegistry] = ()) -> FastAPI:
    """Build the app; it holds no global state (metrics live in the app's own registry). With
    ``tracing`` enabled every generation request gets a ``router`` span whose context the workers join.
    ``/metrics`` also answers the metrics of ``registries`` (the planner's)."""
    gen = Generation(client, tokenizer, config, tracing or Tracing())
    app = FastAPI(title="pdserve", summary="OpenAI-compatible API of a prefill/decode serving cluster.")
    install_handlers(app)
    app.add_middleware(Gatekeeper, api_key=config.api_key, metrics=gen.metrics)
    started_at = int(time.time())

    def body_schema(name: str) -> dict[str, object]:
        ref = {"$ref": f"#/components/schemas/{name}"}
        return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}

    @app.post("/v1/chat/completions", openapi_extra=body_schema("ChatCompletionRequest"))
    async def chat_completions(request: Request) -> Response:
        req = await gen.prepare(request, ChatCompletionRequest)
        assert isinstance(req, ChatCompletionRequest)
        if not tokenizer.has_chat_template:
            raise invalid("This model has no chat template; use /v1/completions.", "messages")
        mode = mode_of(req)
        structured = structured_of(req)
        if mode.grammar is not None:
            if structured is not None:
                raise invalid("An output constraint cannot be combined with a required tool call.",
                              "tool_choice")
            structured = checked_tools(mode.grammar)
        messages, tools = conversation(req, mode, tokenizer.template_has_tools)
        try:
            prompt = await asyncio.to_thread(tokenizer.apply_chat_template, messages, True, tools)
        except Exception as exc:  # the template rejects the conversation (e.g. role order)
            raise invalid(f"Cannot apply the chat template: {exc}", "messages") from None
        job = gen.jobs.build(req, True, [prompt], "messages", structured)
        job.tools = mode if mode.parse else None
        return await gen.run(job, request)

    @app.post("/v1/completions", openapi_extra=body_schema("CompletionRequest"))
    async def completions(request: Request) -> Response:
        req = await gen.prepare(request, CompletionRequest)
        assert isinstance(req, CompletionRequest)
        prompts: list[Prompt] = completion_prompts(req, tokenizer.vocab_size)
        ids = [p if isinstance(p, list) else await asyncio.to_thread(tokenizer.encode, p) for p in prompts]
        if any(not p for p in ids):
            raise invalid("'prompt' encodes to no tokens.", "prompt")
        job = gen.jobs.build(req, False, ids, "prompt", structured_of(req))
        if req.echo:
            job.echo = [p if isinstance(p, str) else tokenizer.decode(p) for p in prompts]
        return await gen.run(job, request)

    add_tokenize_routes(app, tokenizer, config)

    @app.get("/v1/models")
    async def models() -> Json:
        card = {"id": config.model_name, "object": "model", "created": started_at, "owned_by": "pdserve",
                "root": config.model_name, "max_model_len": config.max_model_len}
        return {"object": "list", "data": [card]}

    @app.get("/health")
    async def health() -> Response:
        if client.is_ready():
            return Response(b'{"status":"ok"}', media_type="application/json")
        return unavailable("The server is starting.", code="not_ready").response()

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        text = generate_latest(gen.metrics.registry)
        for registry in registries:
            text += generate_latest(registry)
        if client.is_ready():
            with contextlib.suppress(TimeoutError, RequestFailed):
                stats = await asyncio.wait_for(client.stats(), WORKER_STATS_TIMEOUT)
                text += worker_metrics(stats, client.routing_decisions())
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    add_admin_routes(app, client)
    add_debug_routes(app, client)
    schema_components = openapi_components()

    def openapi() -> dict[str, object]:
        if app.openapi_schema is None:
            schema = FastAPI.openapi(app)
            schema.setdefault("components", {}).setdefault("schemas", {}).update(schema_components)
        return app.openapi_schema or {}

    app.openapi = openapi  # type: ignore[method-assign]
    return app


def checked_tools(grammar: StructuredOutput) -> StructuredOutput:
    """The tool-call grammar, checked: a function's ``parameters`` that are no valid schema is a 400."""
    try:
        check(grammar)
    except GrammarError as exc:
        raise invalid(f"Invalid function parameters in 'tools': {exc}", "tools",
                      code="invalid_grammar") from None
    return grammar

"""The OpenAI-compatible HTTP app: ``create_app(backend, tokenizer, config)``.

Order of checks for a generation request: API key (401), body size (413),
JSON and parameter validation (400), model name (404), readiness (503),
tokenization and length against ``max_model_len`` (400), admission (503 +
Retry-After), then generation under ``request_timeout`` (408, the backend
request aborted). A streaming response starts only once the first token has
arrived, so failures before it still get their status code; a failure after it
ends the stream with an ``error`` event and ``data: [DONE]``. A client that
disconnects has its backend requests aborted. Generation responses carry
``x-pdserve-decode-worker``: the decode worker that produced the first token.
``GET /v1/workers`` and ``POST /v1/workers/{id}/drain`` are the admin endpoints (``router.admin``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass

import msgspec
from fastapi import FastAPI, Request
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.responses import Response

from engine.grammar import GrammarError, check
from engine.sampling_params import StructuredOutput
from engine.tokenizer import Tokenizer
from messages.wire import GenerateRequest
from router.admin import WORKER_STATS_TIMEOUT, add_admin_routes
from router.admission import AdmissionGate, Ticket
from router.backend import Backend
from router.config import RouterSettings
from router.errors import (
    APIError,
    RequestFailed,
    backend_failure,
    install_handlers,
    invalid,
    model_not_found,
    timeout,
    unavailable,
)
from router.http import Gatekeeper, SSEResponse, read_body
from router.metrics import RouterMetrics, worker_metrics
from router.protocol import (
    ChatCompletionRequest,
    CompletionParams,
    CompletionRequest,
    Prompt,
    check_common,
    completion_prompts,
    decode_body,
    logit_bias_of,
    openapi_components,
    sampling_for,
    stop_strings,
)
from router.responses import Envelope, Json, LogprobFormatter, choice, merge_logprobs, role_chunk, usage
from router.streaming import (
    DONE,
    ChoiceDecoder,
    ChoiceDelta,
    ClientGone,
    guarded,
    merge_choices,
    sse,
)
from router.structured import structured_of
from router.telemetry import RequestTelemetry
from router.tokenize import DetokenizeRequest, TokenizeRequest
from router.tools import ToolMode, ToolStream, call_chunks, conversation, mode_of, parse
from telemetry.tracing import Tracing

DECODE_WORKER_HEADER = "x-pdserve-decode-worker"


@dataclass(frozen=True)
class RouterConfig(RouterSettings):
    """How the router serves one model: the user's ``RouterSettings`` (keyword-only) plus what the model
    decides, its served name and context length."""

    model_name: str
    max_model_len: int


@dataclass
class _Job:
    """One HTTP generation request, fanned out into ``len(prompts) x n`` backend requests."""

    req: CompletionParams
    chat: bool
    envelope: Envelope
    prompts: list[list[int]]
    requests: list[GenerateRequest]
    decoders: list[ChoiceDecoder]
    formatters: list[LogprobFormatter]
    tools: ToolMode | None = None  # parse tool calls out of the output
    echo: list[str] | None = None  # completions ``echo``: each prompt's text, ahead of its choices' text

    def echoed(self, index: int) -> str:
        return self.echo[index // self.req.choices] if self.echo else ""

    def finish_reason(self, reason: str | None, calls: int) -> str | None:
        return "tool_calls" if calls and reason == "stop" else reason

    def finish(self, tel: RequestTelemetry, error: BaseException | None = None) -> None:
        """Record usage and end the request's span (a second call does nothing)."""
        tel.finish(self.decoders, [len(p) for p in self.prompts], self.req.choices, error)

    def usage(self) -> Json:
        return usage(self.decoders, [len(p) for p in self.prompts], self.req.choices)


class _Front:
    """The generation endpoints' logic, in the order a request meets it: ``prepare`` (body, model,
    readiness), ``build_job`` (tokens, lengths, one backend request per choice), ``run`` (admission,
    the first token, then ``respond`` as JSON or ``stream`` as SSE)."""

    def __init__(self, backend: Backend, tokenizer: Tokenizer, config: RouterConfig, tracer: Tracing) -> None:
        self.backend = backend
        self.tokenizer = tokenizer
        self.config = config
        self.tracer = tracer
        self.gate = AdmissionGate(config.max_queued_requests, config.max_queued_tokens)
        self.metrics = RouterMetrics(self.gate, config.model_name)
        self.token_text = functools.lru_cache(maxsize=65536)(self._token_text)

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    async def prepare(self, request: Request, type_: type[CompletionParams]) -> CompletionParams:
        config = self.config
        req = decode_body(await read_body(request, config.max_request_bytes), type_)
        check_common(req)
        if req.model != config.model_name:
            raise model_not_found(req.model)
        if not self.backend.is_ready():
            raise unavailable("The server is starting; retry shortly.", code="not_ready")
        return req

    def build_job(self, req: CompletionParams, chat: bool, prompts: list[list[int]], param: str,
                  structured: StructuredOutput | None = None) -> _Job:
        config, n = self.config, req.choices
        bias = logit_bias_of(req, self.tokenizer.vocab_size)
        requests: list[GenerateRequest] = []
        prefix = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        for p_index, prompt in enumerate(prompts):
            if len(prompt) >= config.max_model_len:
                raise invalid(f"The prompt has {len(prompt)} tokens; this model's maximum context length is "
                              f"{config.max_model_len} tokens.", param, code="context_length_exceeded")
            room = config.max_model_len - len(prompt)
            max_tokens = req.requested_max_tokens() or config.default_max_tokens or room
            if max_tokens > room:
                raise invalid(f"The prompt ({len(prompt)} tokens) plus max_tokens ({max_tokens}) exceeds "
                              f"this model's maximum context length of {config.max_model_len} tokens.",
                              "max_tokens", code="context_length_exceeded")
            for i in range(n):
                requests.append(GenerateRequest(
                    request_id=f"{prefix}-{p_index * n + i}", prompt_token_ids=prompt,
                    sampling=sampling_for(req, max_tokens, i, structured, bias), priority=req.priority or 0))
        stops = stop_strings(req)
        tier = "default" if getattr(req, "service_tier", None) is not None else None
        return _Job(
            req, chat, Envelope(prefix, int(time.time()), config.model_name, chat, tier), prompts, requests,
            [ChoiceDecoder(i, self.tokenizer, stops) for i in range(len(requests))],
            [LogprobFormatter(chat, self.token_text) for _ in requests])

    async def run(self, job: _Job, request: Request) -> Response:
        ticket = self.gate.admit(sum(len(p) for p in job.prompts) * job.req.choices)
        admitted = time.monotonic()
        tel = RequestTelemetry(self.tracer, self.metrics, request.headers, job.chat, self.config.model_name,
                               job.requests, job.envelope.id)
        job.requests = tel.stamp(job.requests)
        deltas = guarded(merge_choices(self.backend, job.requests, job.decoders),
                         admitted + self.config.request_timeout, request.is_disconnected)
        try:
            first = await anext(deltas)
        except BaseException as exc:
            ticket.release()
            await deltas.aclose()
            job.finish(tel, exc)
            raise _as_api_error(exc, self.config.request_timeout) from None
        ticket.started()
        tel.first_token()
        self.metrics.ttft.labels(request.url.path).observe(time.monotonic() - admitted)
        worker = {DECODE_WORKER_HEADER: job.decoders[first.index].worker_id}
        if job.req.streaming:
            return SSEResponse(self.stream(job, first, deltas, ticket, tel), media_type="text/event-stream",
                               headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **worker})
        with ticket:
            return await self.respond(job, first, deltas, tel, worker)

    async def respond(self, job: _Job, first: ChoiceDelta, deltas: AsyncGenerator[ChoiceDelta, None],
                      tel: RequestTelemetry, headers: dict[str, str]) -> Response:
        """The whole completion as one JSON body."""
        texts: list[list[str]] = [[] for _ in job.requests]
        lps: list[list[Json]] = [[] for _ in job.requests]
        try:
            delta: ChoiceDelta | None = first
            while delta is not None:
                texts[delta.index].append(delta.text)
                if delta.logprobs:
                    lps[delta.index].append(job.formatters[delta.index].format(delta.logprobs))
                delta = await anext(deltas, None)
                if delta is not None:
                    tel.delta()
        except BaseException as exc:
            job.finish(tel, exc)
            raise _as_api_error(exc, self.config.request_timeout) from None
        job.finish(tel)
        want_lps = job.req.num_logprobs() is not None
        choices = []
        for i, d in enumerate(job.decoders):
            text: str | None = job.echoed(i) + "".join(texts[i])
            calls: list[Json] = []
            if job.tools is not None and job.tools.parse and text is not None:
                text, parsed = parse(text, job.tools.names)
                calls = [c.openai() for c in parsed]
            lp = merge_logprobs(lps[i], job.chat) if want_lps else None
            choices.append(choice(i, text, job.chat, lp, job.finish_reason(d.finish_reason, len(calls)),
                                  chunk=False, tool_calls=calls))
        self.metrics.output_tokens.inc(sum(d.num_tokens for d in job.decoders))
        body = job.envelope.wrap(choices, chunk=False, usage=job.usage())
        return Response(msgspec.json.encode(body), media_type="application/json", headers=headers)

    async def stream(self, job: _Job, first: ChoiceDelta, deltas: AsyncGenerator[ChoiceDelta, None],
                     ticket: Ticket, tel: RequestTelemetry) -> AsyncIterator[bytes]:
        """SSE chunks; the request's telemetry ends once, in ``finally``, with how the stream ended."""
        env, include_usage = job.envelope, job.req.include_usage
        want_lps = job.req.num_logprobs() is not None
        ended: BaseException | None = GeneratorExit("stream closed")
        parsing = job.tools is not None and job.tools.parse
        parsers = [ToolStream(job.tools.names if job.tools else set()) for _ in job.requests]
        echoed = [False] * len(job.requests)
        try:
            if job.chat:
                roles = [role_chunk(i) for i in range(len(job.requests))]
                yield sse(env.wrap(roles, chunk=True, with_usage=include_usage))
            delta: ChoiceDelta | None = first
            while delta is not None:
                text = delta.text
                if not echoed[delta.index]:
                    echoed[delta.index] = True
                    text = job.echoed(delta.index) + text
                if parsing:
                    for ch in self._tool_chunks(job, parsers[delta.index], delta, text):
                        yield sse(env.wrap([ch], chunk=True, with_usage=include_usage))
                elif text or delta.finish_reason is not None or (delta.logprobs and want_lps):
                    lp = job.formatters[delta.index].format(delta.logprobs) if want_lps else None
                    ch = choice(delta.index, text, job.chat, lp, delta.finish_reason, chunk=True)
                    yield sse(env.wrap([ch], chunk=True, with_usage=include_usage))
                delta = await anext(deltas, None)
                if delta is not None:
                    tel.delta()
            self.metrics.output_tokens.inc(sum(d.num_tokens for d in job.decoders))
            ended = None
            job.finish(tel)
            if include_usage:
                yield sse(env.wrap([], chunk=True, usage=job.usage()))
        except ClientGone as exc:
            ended = exc
            return
        except Exception as exc:
            ended = exc
            job.finish(tel, exc)
            yield sse(_as_api_error(exc, self.config.request_timeout).body())
        finally:
            job.finish(tel, ended)
            ticket.release()
            await deltas.aclose()
        yield DONE


    @staticmethod
    def _tool_chunks(job: _Job, parser: ToolStream, delta: ChoiceDelta, text: str) -> list[Json]:
        """A chat delta's chunks once tool calls are parsed out: content pieces, and per complete call
        its id and name, then its arguments in pieces; the finish reason last."""
        events = parser.feed(text)
        if delta.finish_reason is not None:
            events += parser.flush()
        chunks: list[Json] = []
        for event in events:
            if isinstance(event, str):
                chunks.append(choice(delta.index, event, True, None, None, chunk=True))
            else:
                chunks += [choice(delta.index, None, True, None, None, chunk=True, tool_calls=[entry])
                           for entry in call_chunks(event, parser.calls - 1)]
        if delta.finish_reason is not None:
            reason = job.finish_reason(delta.finish_reason, parser.calls)
            chunks.append(choice(delta.index, None, True, None, reason, chunk=True))
        return chunks


def create_app(backend: Backend, tokenizer: Tokenizer, config: RouterConfig,
               tracing: Tracing | None = None, registries: Sequence[CollectorRegistry] = ()) -> FastAPI:
    """Build the app; it holds no global state (metrics live in the app's own registry). With
    ``tracing`` enabled every generation request gets a ``router`` span whose context the workers join.
    ``/metrics`` also answers the metrics of ``registries`` (the planner's)."""
    front = _Front(backend, tokenizer, config, tracing or Tracing())
    app = FastAPI(title="pdserve", summary="OpenAI-compatible API of a prefill/decode serving cluster.")
    install_handlers(app)
    app.add_middleware(Gatekeeper, api_key=config.api_key, metrics=front.metrics)
    started_at = int(time.time())

    def body_schema(name: str) -> dict[str, object]:
        ref = {"$ref": f"#/components/schemas/{name}"}
        return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}

    @app.post("/v1/chat/completions", openapi_extra=body_schema("ChatCompletionRequest"))
    async def chat_completions(request: Request) -> Response:
        req = await front.prepare(request, ChatCompletionRequest)
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
        job = front.build_job(req, True, [prompt], "messages", structured)
        job.tools = mode if mode.parse else None
        return await front.run(job, request)

    @app.post("/v1/completions", openapi_extra=body_schema("CompletionRequest"))
    async def completions(request: Request) -> Response:
        req = await front.prepare(request, CompletionRequest)
        assert isinstance(req, CompletionRequest)
        prompts: list[Prompt] = completion_prompts(req, tokenizer.vocab_size)
        ids = [p if isinstance(p, list) else await asyncio.to_thread(tokenizer.encode, p) for p in prompts]
        if any(not p for p in ids):
            raise invalid("'prompt' encodes to no tokens.", "prompt")
        job = front.build_job(req, False, ids, "prompt", structured_of(req))
        if req.echo:
            job.echo = [p if isinstance(p, str) else tokenizer.decode(p) for p in prompts]
        return await front.run(job, request)

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

    @app.get("/v1/models")
    async def models() -> Json:
        card = {"id": config.model_name, "object": "model", "created": started_at, "owned_by": "pdserve",
                "root": config.model_name, "max_model_len": config.max_model_len}
        return {"object": "list", "data": [card]}

    @app.get("/health")
    async def health() -> Response:
        if backend.is_ready():
            return Response(b'{"status":"ok"}', media_type="application/json")
        return unavailable("The server is starting.", code="not_ready").response()

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        text = generate_latest(front.metrics.registry)
        for registry in registries:
            text += generate_latest(registry)
        if backend.is_ready():
            with contextlib.suppress(TimeoutError, RequestFailed):
                stats = await asyncio.wait_for(backend.stats(), WORKER_STATS_TIMEOUT)
                text += worker_metrics(stats, backend.routing_decisions())
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    add_admin_routes(app, backend)

    @app.get("/v1/prefix_index")
    async def prefix_index() -> Response:
        """Whether the router's prefix index agrees with each live worker's cached blocks (a snapshot):
        ``{"agrees": bool, "workers": [{"worker_id", "indexed_blocks", "cached_blocks", "missing",
        "extra", "agrees"}]}``. Under traffic they differ by the events not folded in yet."""
        if not backend.is_ready():
            raise unavailable("The server is starting; retry shortly.", code="not_ready")
        try:
            rows = await asyncio.wait_for(backend.prefix_index_agreement(), WORKER_STATS_TIMEOUT)
        except (TimeoutError, RequestFailed) as exc:
            raise unavailable(f"Worker snapshots unavailable: {type(exc).__name__}",
                              code="stats_unavailable") from None
        body = {"agrees": bool(rows) and all(r.agrees for r in rows), "workers": rows}
        return Response(msgspec.json.encode(body), media_type="application/json")

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


def _as_api_error(exc: BaseException, request_timeout: float) -> APIError:
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, TimeoutError):
        return timeout(request_timeout)
    if isinstance(exc, RequestFailed):
        return backend_failure(exc)
    if isinstance(exc, ClientGone):
        return APIError(499, "Client closed the request.", code="client_closed_request")
    if isinstance(exc, StopAsyncIteration):
        return unavailable("The backend ended the request without output.", code="aborted")
    if isinstance(exc, Exception):
        return APIError(500, f"Internal server error: {type(exc).__name__}", type="server_error",
                        code="internal_error")
    raise exc

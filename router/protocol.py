"""The OpenAI request bodies the router accepts, parsed from raw bytes with msgspec.

``decode_body`` turns any malformed body into a 400 naming the parameter: bytes
that are not UTF-8, text that is not JSON, JSON that is not an object, a field of
the wrong type or out of range, and a top-level field neither OpenAI nor the
vLLM extras below define (refused, as OpenAI does: nothing is silently ignored;
keys inside a message object that only describe a past response, such as
``refusal`` or ``annotations``, are ignored). Every declared field is honoured
or refused by ``check_common`` (see ``UNSUPPORTED``). Ranges match
``engine.sampling.SamplingParams``; the engine checks them again. The same
structs give ``/openapi.json`` its request schemas.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Annotated, Any, Literal, TypeVar

import msgspec
from msgspec import Meta

from engine.sampling_params import SamplingParams, StructuredOutput
from router.errors import invalid

MAX_N = 16
MAX_STOP = 4
MAX_LOGPROBS = 20

Seed = Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)]
PositiveInt = Annotated[int, Meta(ge=1)]
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
Role = Literal["system", "developer", "user", "assistant", "tool"]
T = TypeVar("T")


class TextPart(msgspec.Struct, frozen=True):
    type: Literal["text"]
    text: str


class FunctionCall(msgspec.Struct, frozen=True):
    name: str
    arguments: str


class ToolCall(msgspec.Struct, frozen=True):
    id: str
    function: FunctionCall
    type: Literal["function"] = "function"


class FunctionDef(msgspec.Struct, frozen=True):
    name: Annotated[str, Meta(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(msgspec.Struct, frozen=True):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(msgspec.Struct, frozen=True):
    name: str


class NamedToolChoice(msgspec.Struct, frozen=True):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class JsonSchemaFormat(msgspec.Struct, frozen=True, kw_only=True):
    name: Annotated[str, Meta(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None


class ResponseFormat(msgspec.Struct, frozen=True, kw_only=True):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """vLLM's ``structured_outputs`` object: exactly one of its fields."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class ChatMessage(msgspec.Struct, frozen=True):
    role: Role
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class StreamOptions(msgspec.Struct, frozen=True):
    include_usage: bool = False


class CompletionParams(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Fields shared by both endpoints (OpenAI's, then vLLM-style extras)."""

    model: str
    max_tokens: PositiveInt | None = None
    temperature: Annotated[float, Meta(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] | None = None
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    seed: Seed | None = None
    stop: str | list[str] | None = None
    n: Annotated[int, Meta(ge=1, le=MAX_N)] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None
    top_k: Annotated[int, Meta(ge=-1)] | None = None
    ignore_eos: bool | None = None
    priority: Annotated[int, Meta(ge=-(2**31), le=2**31 - 1)] | None = None
    min_tokens: Annotated[int, Meta(ge=0)] | None = None
    repetition_penalty: Annotated[float, Meta(gt=0.0, le=10.0)] | None = None
    logit_bias: dict[str, Annotated[float, Meta(ge=-100.0, le=100.0)]] | None = None
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputs | None = None

    @property
    def choices(self) -> int:
        return self.n or 1

    @property
    def streaming(self) -> bool:
        return bool(self.stream)

    @property
    def include_usage(self) -> bool:
        return self.streaming and self.stream_options is not None and self.stream_options.include_usage

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def num_logprobs(self) -> int | None:
        return None


class ChatCompletionRequest(CompletionParams, frozen=True, kw_only=True, forbid_unknown_fields=True):
    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # OpenAI fields that are refused unless they ask for what the server does anyway (see UNSUPPORTED)
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    service_tier: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    web_search_options: dict[str, Any] | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    moderation: dict[str, Any] | None = None

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def conversation(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.text()} for m in self.messages]


class CompletionRequest(CompletionParams, frozen=True, kw_only=True, forbid_unknown_fields=True):
    prompt: str | list[str | int | list[int]]
    logprobs: Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: bool | None = None
    best_of: Annotated[int, Meta(ge=1, le=MAX_N)] | None = None
    suffix: str | None = None

    def num_logprobs(self) -> int | None:
        return self.logprobs


Prompt = str | list[int]

_AT = re.compile(r" - at `\$\.?(.*)`$")
_MISSING = re.compile(r"(?:missing required|unknown) field `([^`]+)`")


def _param_of(message: str) -> str | None:
    at = _AT.search(message)
    missing = _MISSING.search(message)
    path = at.group(1) if at else ""
    if missing:
        return f"{path}.{missing.group(1)}" if path else missing.group(1)
    return path or None


def decode_body(raw: bytes, type_: type[T]) -> T:
    """Parse a request body into ``type_``; raises a 400 APIError naming the bad parameter."""
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise invalid(f"Request body is not valid UTF-8 (byte {exc.start}).") from None
    if not raw.strip():
        raise invalid("Request body is empty; expected a JSON object.")
    try:
        return msgspec.json.decode(raw, type=type_)
    except msgspec.ValidationError as exc:
        text = str(exc)
        if text.startswith("Expected `object`, got"):
            raise invalid(f"Request body must be a JSON object: {text}.") from None
        raise invalid(f"Invalid parameter: {text}.", _param_of(text)) from None
    except msgspec.DecodeError as exc:
        raise invalid(f"Request body is not valid JSON: {exc}.") from None


def check_common(req: CompletionParams) -> None:
    """Cross-field checks msgspec cannot express; raises a 400 APIError."""
    stops = stop_strings(req)
    if len(stops) > MAX_STOP:
        raise invalid(f"'stop' may hold at most {MAX_STOP} strings, got {len(stops)}.", "stop")
    if any(not s for s in stops):
        raise invalid("'stop' strings must not be empty.", "stop")
    max_tokens = req.requested_max_tokens()
    if req.min_tokens and max_tokens is not None and req.min_tokens > max_tokens:
        raise invalid(f"'min_tokens' ({req.min_tokens}) must not exceed max_tokens ({max_tokens}).",
                      "min_tokens")
    if req.stream_options is not None and not req.streaming:
        raise invalid("'stream_options' is only allowed when 'stream' is true.", "stream_options")
    if isinstance(req, ChatCompletionRequest) and req.top_logprobs is not None and not req.logprobs:
        raise invalid("'top_logprobs' requires 'logprobs' to be true.", "top_logprobs")
    for name, refused in UNSUPPORTED.items():
        reason = refused(req)
        if reason:
            raise invalid(f"'{name}' {reason}.", name, code="unsupported_parameter")


def _when(cond: object, reason: str) -> str | None:
    return reason if cond else None


def _field(req: CompletionParams, name: str) -> object:
    return getattr(req, name, None)


# Declared fields this server refuses (a 400 naming the field, code ``unsupported_parameter``), each with
# the condition under which it is refused; a value that asks for what the server does anyway is accepted.
UNSUPPORTED: dict[str, Callable[[CompletionParams], str | None]] = {
    "modalities": lambda r: _when(_field(r, "modalities") not in (None, ["text"]),
                                  "may only be [\"text\"]: this model produces text only"),
    "audio": lambda r: _when(_field(r, "audio") is not None,
                             "is not supported: this model produces text only"),
    "prediction": lambda r: _when(_field(r, "prediction") is not None,
                                  "(predicted outputs) is not supported"),
    "service_tier": lambda r: _when(_field(r, "service_tier") not in (None, "auto", "default"),
                                    "must be 'auto' or 'default': this server has one tier"),
    "store": lambda r: _when(_field(r, "store"), "must be false: this server stores no completions"),
    "metadata": lambda r: _when(_field(r, "metadata") is not None,
                                "is only kept with stored completions, which this server does not store"),
    "reasoning_effort": lambda r: _when(_field(r, "reasoning_effort") is not None,
                                        "is not supported: this model does not reason"),
    "verbosity": lambda r: _when(_field(r, "verbosity") is not None, "is not supported"),
    "web_search_options": lambda r: _when(_field(r, "web_search_options") is not None,
                                          "is not supported: this server has no web search"),
    "functions": lambda r: _when(_field(r, "functions") is not None,
                                 "is deprecated and not supported; use 'tools'"),
    "function_call": lambda r: _when(_field(r, "function_call") is not None,
                                     "is deprecated and not supported; use 'tool_choice'"),
    "prompt_cache_retention": lambda r: _when(_field(r, "prompt_cache_retention") not in (None, "in_memory"),
                                              "must be 'in_memory': the prefix cache lives in memory"),
    "prompt_cache_options": lambda r: _when(_field(r, "prompt_cache_options") is not None,
                                            "is not supported: prefix caching is automatic"),
    "moderation": lambda r: _when(_field(r, "moderation") is not None,
                                  "is not supported: this server runs no moderation"),
    "best_of": lambda r: _when((b := _field(r, "best_of")) is not None and b != r.choices,
                               "must equal n: candidates are not ranked on this server"),
    "suffix": lambda r: _when(_field(r, "suffix") is not None, "(insertion) is not supported"),
    "echo": lambda r: _when(_field(r, "echo") and r.num_logprobs() is not None,
                            "cannot be combined with 'logprobs': prompt logprobs are not computed"),
}


def stop_strings(req: CompletionParams) -> list[str]:
    if req.stop is None:
        return []
    return [req.stop] if isinstance(req.stop, str) else list(req.stop)


def completion_prompts(req: CompletionRequest, vocab_size: int) -> list[Prompt]:
    """The prompts of a completions body: text, texts, token ids, or lists of token ids (never mixed)."""
    prompt = req.prompt
    if isinstance(prompt, str):
        prompts: list[Prompt] = [prompt]
    elif not prompt:
        raise invalid("'prompt' must not be empty.", "prompt")
    elif all(isinstance(p, str) for p in prompt):
        prompts = [p for p in prompt if isinstance(p, str)]
    elif all(isinstance(p, int) for p in prompt):
        prompts = [[p for p in prompt if isinstance(p, int)]]
    elif all(isinstance(p, list) for p in prompt):
        prompts = [p for p in prompt if isinstance(p, list)]
    else:
        raise invalid("'prompt' must be a string, a list of strings, a list of token ids or a list of "
                      "lists of token ids, not a mixture.", "prompt")
    for p in prompts:
        if len(p) == 0:
            raise invalid("'prompt' must not be empty.", "prompt")
        if isinstance(p, list) and any(not 0 <= t < vocab_size for t in p):
            raise invalid(f"token ids in 'prompt' must be in [0, {vocab_size}).", "prompt")
    return prompts


def logit_bias_of(req: CompletionParams, vocab_size: int) -> tuple[tuple[int, float], ...]:
    """``logit_bias`` as (token id, bias) pairs; a key that is not a token id of this model is a 400."""
    pairs = []
    for key, bias in (req.logit_bias or {}).items():
        if not key.isdigit() or int(key) >= vocab_size:
            raise invalid(f"'logit_bias' keys must be token ids in [0, {vocab_size}), got {key!r}.",
                          "logit_bias")
        pairs.append((int(key), float(bias)))
    return tuple(sorted(pairs))


def sampling_for(req: CompletionParams, max_tokens: int, index: int,
                 structured: StructuredOutput | None = None,
                 logit_bias: tuple[tuple[int, float], ...] = ()) -> SamplingParams:
    """The engine's sampling parameters of choice ``index`` (a seeded request uses ``seed + index``);
    a value the engine refuses is a 400 naming it."""
    seed = None if req.seed is None else req.seed + index
    try:
        return _sampling(req, max_tokens, seed, structured, logit_bias)
    except ValueError as exc:
        raise invalid(str(exc), str(exc).split(" ", 1)[0]) from None


def _sampling(req: CompletionParams, max_tokens: int, seed: int | None, structured: StructuredOutput | None,
              logit_bias: tuple[tuple[int, float], ...]) -> SamplingParams:
    return SamplingParams(
        max_tokens=max_tokens,
        min_tokens=req.min_tokens or 0,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_k=req.top_k or 0,
        top_p=1.0 if req.top_p is None else req.top_p,
        min_p=req.min_p or 0.0,
        seed=seed,
        ignore_eos=bool(req.ignore_eos),
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        logprobs=req.num_logprobs(),
        structured=structured,
        logit_bias=logit_bias,
    )


def openapi_components() -> dict[str, Any]:
    """JSON schemas of the request bodies, as OpenAPI components."""
    _, components = msgspec.json.schema_components(
        [ChatCompletionRequest, CompletionRequest], ref_template="#/components/schemas/{name}")
    return components

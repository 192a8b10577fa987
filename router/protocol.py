"""The OpenAI request bodies the router accepts, parsed from raw bytes with msgspec.

``decode_body`` turns any malformed body into a 400 naming the parameter: bytes
that are not UTF-8, text that is not JSON, JSON that is not an object, a field of
the wrong type or out of range. Unknown fields are ignored (as OpenAI does).
Ranges match ``engine.sampling.SamplingParams``; the engine checks them again.
The same structs give ``/openapi.json`` its request schemas.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal, TypeVar

import msgspec
from msgspec import Meta

from engine.sampling_params import SamplingParams
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


class ChatMessage(msgspec.Struct, frozen=True):
    role: Role
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class StreamOptions(msgspec.Struct, frozen=True):
    include_usage: bool = False


class CompletionParams(msgspec.Struct, frozen=True, kw_only=True):
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


class ChatCompletionRequest(CompletionParams, frozen=True, kw_only=True):
    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)] | None = None

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def conversation(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.text()} for m in self.messages]


class CompletionRequest(CompletionParams, frozen=True, kw_only=True):
    prompt: str | list[str | int | list[int]]
    logprobs: Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: bool | None = None

    def num_logprobs(self) -> int | None:
        return self.logprobs


Prompt = str | list[int]

_AT = re.compile(r" - at `\$\.?(.*)`$")
_MISSING = re.compile(r"missing required field `([^`]+)`")


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
    if isinstance(req, CompletionRequest) and req.echo:
        raise invalid("'echo' is not supported.", "echo")


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


def sampling_for(req: CompletionParams, max_tokens: int, index: int) -> SamplingParams:
    """The engine's sampling parameters of choice ``index`` (a seeded request uses ``seed + index``);
    a value the engine refuses is a 400 naming it."""
    seed = None if req.seed is None else req.seed + index
    try:
        return _sampling(req, max_tokens, seed)
    except ValueError as exc:
        raise invalid(str(exc), str(exc).split(" ", 1)[0]) from None


def _sampling(req: CompletionParams, max_tokens: int, seed: int | None) -> SamplingParams:
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
    )


def openapi_components() -> dict[str, object]:
    """JSON schemas of the request bodies, as OpenAPI components."""
    _, components = msgspec.json.schema_components(
        [ChatCompletionRequest, CompletionRequest], ref_template="#/components/schemas/{name}")
    return components

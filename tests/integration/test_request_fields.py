"""Every field of OpenAI's chat and completions request bodies is honoured or refused, never ignored.

The field lists come from the installed openai client's request types, so a field it adds later fails
``test_every_openai_field_is_in_the_table`` until it is decided here. A refused field is a 400 whose
error names it; an honoured one is checked for its effect (greedy requests, ``ignore_eos`` so lengths are
exact, a handful of tokens each). Runs against the shared disaggregated server.
"""

from __future__ import annotations

import json
import typing
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import httpx
import pytest
from openai.types import completion_create_params as completion_params
from openai.types.chat import completion_create_params as chat_params

if TYPE_CHECKING:
    from tests.integration.conftest import PdserveServer

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct.Q4_1"
Body = dict[str, Any]
Check = Callable[[httpx.Response, "Baseline"], None]


def chat_body(**extra: Any) -> Body:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Name a fruit."}], "max_tokens": 4,
            "temperature": 0, "ignore_eos": True, **extra}


def completion_body(**extra: Any) -> Body:
    return {"model": MODEL, "prompt": "The fruit of the day is", "max_tokens": 4, "temperature": 0,
            "ignore_eos": True, **extra}


class Baseline:
    """What the checks compare with: greedy outputs of the plain bodies, seeded samples, and the text of
    ``BIAS_TOKEN`` four times."""

    def __init__(self, url: str) -> None:
        def post(path: str, body: Body) -> Body:
            return dict(httpx.post(f"{url}{path}", json=body, timeout=120).json())

        self.chat: Body = post("/v1/chat/completions", chat_body())
        self.completion: Body = post("/v1/completions", completion_body())
        self.chat_seeded: str = text(post("/v1/chat/completions", chat_body(**SEEDED)))
        self.completion_seeded: str = text(post("/v1/completions", completion_body(**SEEDED)))
        self.forced: str = str(post("/detokenize", {"model": MODEL, "tokens": [BIAS_TOKEN] * 4})["prompt"])

    @property
    def chat_text(self) -> str:
        return str(self.chat["choices"][0]["message"]["content"])

    @property
    def completion_text(self) -> str:
        return str(self.completion["choices"][0]["text"])


def refused(field: str, status: int = 400) -> Check:
    def check(resp: httpx.Response, _: Baseline) -> None:
        assert resp.status_code == status, resp.text
        assert resp.json()["error"]["param"] == field, resp.text
    return check


def ok(assertion: Callable[[Body, Baseline], bool]) -> Check:
    def check(resp: httpx.Response, base: Baseline) -> None:
        assert resp.status_code == 200, resp.text
        assert assertion(resp.json(), base), resp.text
    return check


def text(body: Body, i: int = 0) -> str:
    c = body["choices"][i]
    return str(c["message"]["content"] if "message" in c else c["text"])


def tokens(body: Body) -> int:
    return int(body["usage"]["completion_tokens"])


SAME_AS_GREEDY = ok(lambda b, base: text(b) == (base.chat_text if "message" in b["choices"][0]
                                                    else base.completion_text))
BIAS_TOKEN = 28  # a token id: forced by a +100 bias
SEEDED = {"seed": 7, "temperature": 1.0, "max_tokens": 8}
FORCED = ok(lambda b, base: text(b) == base.forced)

# (field, request body extras, check); chat and completions share the sampling fields
CHAT: list[tuple[str, Body, Check]] = [
    ("messages", {}, ok(lambda b, _: bool(text(b)))),
    ("model", {"model": "other"}, refused("model", 404)),
    ("frequency_penalty", {"frequency_penalty": 2.0, "max_tokens": 16, "messages": [
        {"role": "user", "content": "Say dog dog dog dog dog dog dog dog."}]},
     ok(lambda b, _: len(set(text(b).split())) > 2)),
    ("presence_penalty", {"presence_penalty": 2.0, "max_tokens": 16, "messages": [
        {"role": "user", "content": "Say dog dog dog dog dog dog dog dog."}]},
     ok(lambda b, _: len(set(text(b).split())) > 2)),
    ("logit_bias", {"logit_bias": {str(BIAS_TOKEN): 100}}, FORCED),
    ("logprobs", {"logprobs": True}, ok(lambda b, _: len(b["choices"][0]["logprobs"]["content"]) == 4)),
    ("top_logprobs", {"logprobs": True, "top_logprobs": 3},
     ok(lambda b, _: all(len(t["top_logprobs"]) == 3 for t in b["choices"][0]["logprobs"]["content"]))),
    ("max_completion_tokens", {"max_completion_tokens": 2}, ok(lambda b, _: tokens(b) == 2)),
    ("max_tokens", {"max_tokens": 3}, ok(lambda b, _: tokens(b) == 3)),
    ("n", {"n": 2}, ok(lambda b, _: [c["index"] for c in b["choices"]] == [0, 1])),
    ("seed", SEEDED, ok(lambda b, base: text(b) == base.chat_seeded)),
    ("stop", {"stop": ["\n"], "max_tokens": 3}, ok(lambda b, _: "\n" not in text(b))),
    ("stream_options", {"stream": True, "stream_options": {"include_usage": True}}, ok(lambda b, _: True)),
    ("temperature", {"temperature": 0}, SAME_AS_GREEDY),
    ("top_p", {"temperature": 1.0, "top_p": 1e-9}, SAME_AS_GREEDY),
    ("user", {"user": "u-1"}, SAME_AS_GREEDY),  # an end-user id: no effect on generation
    ("safety_identifier", {"safety_identifier": "s-1"}, SAME_AS_GREEDY),  # likewise
    ("prompt_cache_key", {"prompt_cache_key": "k-1"}, SAME_AS_GREEDY),  # prefix caching is automatic
    ("prompt_cache_retention", {"prompt_cache_retention": "24h"}, refused("prompt_cache_retention")),
    ("prompt_cache_options", {"prompt_cache_options": {}}, refused("prompt_cache_options")),
    ("response_format", {"response_format": {"type": "json_object"}, "max_tokens": 40, "ignore_eos": False},
     ok(lambda b, _: text(b).startswith("{"))),
    ("tools", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
               "tool_choice": "required", "max_tokens": 30, "ignore_eos": False},
     ok(lambda b, _: b["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "f")),
    ("tool_choice", {"tool_choice": "required"}, refused("tool_choice")),  # without tools
    ("parallel_tool_calls", {"parallel_tool_calls": False}, refused("parallel_tool_calls")),  # likewise
    ("modalities", {"modalities": ["audio"]}, refused("modalities")),
    ("audio", {"audio": {"voice": "alloy", "format": "mp3"}}, refused("audio")),
    ("prediction", {"prediction": {"type": "content", "content": "x"}}, refused("prediction")),
    ("service_tier", {"service_tier": "default"}, ok(lambda b, _: b["service_tier"] == "default")),
    ("store", {"store": True}, refused("store")),
    ("metadata", {"metadata": {"k": "v"}}, refused("metadata")),
    ("reasoning_effort", {"reasoning_effort": "low"}, refused("reasoning_effort")),
    ("verbosity", {"verbosity": "low"}, refused("verbosity")),
    ("web_search_options", {"web_search_options": {}}, refused("web_search_options")),
    ("functions", {"functions": [{"name": "f"}]}, refused("functions")),
    ("function_call", {"function_call": "auto"}, refused("function_call")),
    ("moderation", {"moderation": {}}, refused("moderation")),
    ("not_an_openai_field", {"not_an_openai_field": 1}, refused("not_an_openai_field")),
]
COMPLETIONS: list[tuple[str, Body, Check]] = [
    ("prompt", {}, ok(lambda b, _: tokens(b) == 4)),
    ("model", {"model": "other"}, refused("model", 404)),
    ("echo", {"echo": True}, ok(lambda b, base: text(b) == "The fruit of the day is" + base.completion_text)),
    ("best_of", {"best_of": 3}, refused("best_of")),
    ("suffix", {"suffix": "!"}, refused("suffix")),
    ("logprobs", {"logprobs": 2},
     ok(lambda b, _: all(len(t) == 2 for t in b["choices"][0]["logprobs"]["top_logprobs"]))),
    ("logit_bias", {"logit_bias": {str(BIAS_TOKEN): 100}}, FORCED),
    ("frequency_penalty", {"frequency_penalty": -3}, refused("frequency_penalty")),  # out of range
    ("presence_penalty", {"presence_penalty": 3}, refused("presence_penalty")),
    ("max_tokens", {"max_tokens": 2}, ok(lambda b, _: tokens(b) == 2)),
    ("n", {"n": 3}, ok(lambda b, _: len(b["choices"]) == 3)),
    ("seed", SEEDED, ok(lambda b, base: text(b) == base.completion_seeded)),
    ("stop", {"stop": "zzz"}, SAME_AS_GREEDY),
    ("stream_options", {"stream_options": {"include_usage": True}}, refused("stream_options")),  # no stream
    ("temperature", {"temperature": 0}, SAME_AS_GREEDY),
    ("top_p", {"temperature": 1.0, "top_p": 1e-9}, SAME_AS_GREEDY),
    ("user", {"user": "u-1"}, SAME_AS_GREEDY),
    ("not_an_openai_field", {"not_an_openai_field": 1}, refused("not_an_openai_field")),
]


def test_every_openai_field_is_in_the_table() -> None:
    chat = set(typing.get_type_hints(chat_params.CompletionCreateParamsBase)) | {"stream"}
    completions = set(typing.get_type_hints(completion_params.CompletionCreateParamsBase)) | {"stream"}
    covered_chat = {f for f, _, _ in CHAT} | {"stream"}  # stream: every streaming test
    covered_completions = {f for f, _, _ in COMPLETIONS} | {"stream"}
    assert chat - covered_chat == set()
    assert completions - covered_completions == set()


def _post(url: str, path: str, body: Body) -> httpx.Response:
    if not body.get("stream"):
        return httpx.post(f"{url}{path}", json=body, timeout=120)
    with httpx.stream("POST", f"{url}{path}", json=body, timeout=120) as resp:
        events = [json.loads(line[6:]) for line in resp.iter_lines()
                  if line.startswith("data: {")]
        assert resp.status_code == 200 and events[-1]["usage"]["completion_tokens"] == 4
        return httpx.Response(200, json=events[-1])


def test_fields_are_honoured_or_refused(pdserve_server: PdserveServer) -> None:
    url = pdserve_server.url
    base = Baseline(url)
    cases = [("/v1/chat/completions", f, chat_body(**extra), check) for f, extra, check in CHAT]
    cases += [("/v1/completions", f, completion_body(**extra), check) for f, extra, check in COMPLETIONS]
    with ThreadPoolExecutor(4) as pool:
        responses = list(pool.map(lambda c: _post(url, c[0], c[2]), cases))
    failures = []
    for (path, field, _, check), resp in zip(cases, responses, strict=True):
        try:
            check(resp, base)
        except AssertionError as exc:
            failures.append(f"{path} {field}: {exc}")
    assert failures == []


def test_bad_logit_bias_keys_are_refused(pdserve_server: PdserveServer) -> None:
    url = pdserve_server.url
    bad = httpx.post(f"{url}/v1/completions", json=completion_body(logit_bias={"x": 1}), timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "logit_bias"


def test_tokenize_detokenize_and_models(pdserve_server: PdserveServer) -> None:
    url = pdserve_server.url
    tok = httpx.post(f"{url}/tokenize", json={"model": MODEL, "prompt": "Hello world"}, timeout=30).json()
    assert tok["count"] == len(tok["tokens"]) > 0
    models = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]
    assert tok["max_model_len"] == models["max_model_len"] > 0
    back = httpx.post(f"{url}/detokenize", json={"model": MODEL, "tokens": tok["tokens"]}, timeout=30).json()
    assert back == {"prompt": "Hello world"}
    hi = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}
    chat = httpx.post(f"{url}/tokenize", json=hi, timeout=30).json()
    assert chat["count"] > tok["count"]  # the template's tokens around the message
    bad = httpx.post(f"{url}/tokenize", json={"model": MODEL, "prompt": "x", "foo": 1}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "foo"

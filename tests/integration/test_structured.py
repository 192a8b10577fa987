"""Structured outputs and tool calls with the official openai client against `pdserve serve` (the shared
disaggregated server: 1 prefill, 1 decode).

Sampled requests (temperature > 0, seeds) run concurrently so the decode worker batches them; every output
is checked against its schema, and tool calls as the client reassembles them.
"""

from __future__ import annotations

import enum
import json
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

if TYPE_CHECKING:
    from tests.integration.conftest import PdserveServer

pytestmark = pytest.mark.slow


class Person(BaseModel):  # flat
    name: str = Field(max_length=10)
    age: int = Field(ge=0, le=120)
    employed: bool


class Line(BaseModel):
    sku: str = Field(max_length=6)
    qty: int = Field(ge=1, le=9)


class Order(BaseModel):  # a nested list and an optional field
    lines: list[Line] = Field(min_length=1, max_length=2)
    note: str | None = Field(max_length=8)


class Color(enum.Enum):
    RED = "red"
    GREEN = "green"
    BLUE = "blue"


class Paint(BaseModel):  # enums
    color: Color
    accents: list[Color] = Field(max_length=2)


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "unit": {"enum": ["C", "F"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Current time in a timezone.",
    "parameters": {"type": "object", "properties": {"tz": {"type": "string", "maxLength": 10}},
                   "required": ["tz"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def client(pdserve_server: PdserveServer) -> Any:
    return openai.OpenAI(base_url=f"{pdserve_server.url}/v1", api_key="none", max_retries=0, timeout=180)


@pytest.fixture(scope="module")
def model(client: Any) -> str:
    return str(client.models.list().data[0].id)


def ask(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def test_parse_pydantic_models_sampled(client: Any, model: str) -> None:
    """Three shapes, temperature 0.9, n=2 (seed, seed + 1 per choice): every choice parses and validates."""
    cases = [(Person, "Describe a person.", 11), (Order, "Write an order.", 22), (Paint, "Pick paint.", 33)]

    def one(case: tuple[type[BaseModel], str, int]) -> Any:
        shape, prompt, seed = case
        return client.chat.completions.parse(model=model, messages=ask(prompt), response_format=shape,
                                             temperature=0.9, seed=seed, n=2, max_tokens=70)

    with ThreadPoolExecutor(len(cases)) as pool:
        results = list(pool.map(one, cases))
    for (shape, _, _), result in zip(cases, results, strict=True):
        assert len(result.choices) == 2
        for c in result.choices:
            assert c.finish_reason == "stop", c.message.content
            assert isinstance(c.message.parsed, shape)
            assert shape.model_validate_json(c.message.content) == c.message.parsed


def test_json_object_stream_and_metrics(pdserve_server: PdserveServer, client: Any, model: str) -> None:
    schema = {**Person.model_json_schema(), "additionalProperties": False}

    def json_object() -> Any:
        return client.chat.completions.create(model=model, messages=ask("Give a JSON object with one key."),
                                              response_format={"type": "json_object"}, temperature=0,
                                              max_tokens=60)

    def streamed() -> str:
        fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}
        chunks = client.chat.completions.create(model=model, messages=ask("Describe a person."),
                                                response_format=fmt, temperature=0.7, seed=6,
                                                max_tokens=60, stream=True)
        pieces = [c.choices[0].delta.content or "" for c in chunks if c.choices]
        assert len([p for p in pieces if p]) > 1  # really streamed in pieces
        return "".join(pieces)

    with ThreadPoolExecutor(2) as pool:
        obj, text = pool.submit(json_object), pool.submit(streamed)
        body, joined = obj.result(), text.result()
    assert body.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(body.choices[0].message.content), dict)
    jsonschema.validate(json.loads(joined), schema)
    metrics = httpx.get(f"{pdserve_server.url}/metrics", timeout=10).text
    counts = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
              if line.startswith("pdserve:grammar_") or line.startswith("pdserve:structured_requests")}
    assert counts["pdserve:structured_requests_total"] >= 2
    assert counts["pdserve:grammar_compiles_total"] >= 1 and counts["pdserve:grammar_mask_steps_total"] >= 1


def test_guided_choice_regex_on_completions(client: Any, model: str) -> None:
    out = client.completions.create(model=model, prompt="The sky is", max_tokens=8, temperature=1.0, seed=1,
                                    n=2, extra_body={"guided_choice": ["blue", "green"]})
    assert sorted(c.text for c in out.choices) <= ["blue", "blue", "green", "green"]
    assert all(c.text in ("blue", "green") for c in out.choices)
    out = client.completions.create(model=model, prompt="Code:", max_tokens=8, temperature=1.0, seed=2,
                                    extra_body={"structured_outputs": {"regex": "[A-Z]{2}-[0-9]{2}"}})
    assert len(out.choices[0].text) == 5 and out.choices[0].text[2] == "-", out.choices[0].text


def test_invalid_schema_is_a_400_naming_response_format(pdserve_server: PdserveServer, model: str) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "nonsense"}}}
    resp = httpx.post(f"{pdserve_server.url}/v1/chat/completions", timeout=30,
                      json={"model": model, "messages": ask("Hi"), "response_format": fmt})
    assert resp.status_code == 400
    assert resp.json()["error"]["param"] == "response_format"
    assert "nonsense" in resp.json()["error"]["message"]


def test_required_and_named_tool_calls(client: Any, model: str) -> None:
    """``required`` (not streamed) and a named function (streamed, reassembled by the client)."""
    def required() -> Any:
        return client.chat.completions.create(
            model=model, messages=ask("What is the weather in Paris?"), tools=[WEATHER, TIME],
            tool_choice="required", parallel_tool_calls=False, temperature=0.8, seed=3, max_tokens=60)

    def named() -> Any:
        with client.chat.completions.stream(
                model=model, messages=ask("What time is it in Tokyo?"), tools=[WEATHER, TIME],
                tool_choice={"type": "function", "function": {"name": "get_time"}},
                temperature=0.8, seed=4, max_tokens=60) as stream:
            kinds = [e.type for e in stream]
            final = stream.get_final_completion()
        assert "tool_calls.function.arguments.delta" in kinds  # arguments came in pieces
        return final

    with ThreadPoolExecutor(2) as pool:
        a, b = pool.submit(required), pool.submit(named)
        req, nam = a.result(), b.result()
    for result, names in ((req, {"get_weather", "get_time"}), (nam, {"get_time"})):
        c = result.choices[0]
        assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1
        call = c.message.tool_calls[0]
        assert call.id.startswith("call_") and call.type == "function" and call.function.name in names
        spec = WEATHER if call.function.name == "get_weather" else TIME
        jsonschema.validate(json.loads(call.function.arguments), spec["function"]["parameters"])  # type: ignore[index]


def test_tool_history_accepted_and_auto_without_a_call(client: Any, model: str) -> None:
    history = [*ask("What is the weather in Paris?"),
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "C"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'}]
    out = client.chat.completions.create(model=model, messages=history, tools=[WEATHER], temperature=0,
                                         max_tokens=12, tool_choice="none")
    assert out.choices[0].message.content and out.choices[0].message.tool_calls is None
    plain = client.chat.completions.create(model=model, messages=ask("Say hello to Anna."), tools=[WEATHER],
                                           tool_choice="auto", temperature=0, max_tokens=12)
    c = plain.choices[0]
    assert c.message.tool_calls is None and c.finish_reason in ("stop", "length") and c.message.content

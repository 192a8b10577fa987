"""Structured outputs and tool calls with the official openai client against `pdserve serve` (the shared
disaggregated server: 1 prefill, 1 decode).

Sampled requests (temperature > 0, seeds) run concurrently so the decode worker batches them; every output
is checked against its schema, and tool calls as the client reassembles them.

Greedy Pydantic schemas: objects admit no key their model does not declare, so replies end in ``stop`` and
parse; ``strict: true`` also requires every declared key; a schema strict mode cannot honour is a 400 in
OpenAI's shape. Pydantic's own ``model_json_schema()`` never says ``additionalProperties: false``; the
client's ``parse()`` sends a schema that does (``to_strict_json_schema``), so both are tried.
"""

from __future__ import annotations

import enum
import functools
import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Annotated, Any, get_args, get_origin

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


class City(BaseModel):  # the shape a new user tried first
    name: str = Field(max_length=40)
    country: str = Field(max_length=40)
    is_capital: bool


class Genre(enum.Enum):
    FICTION = "fiction"
    HISTORY = "history"
    SCIENCE = "science"


class Author(BaseModel):
    name: str = Field(max_length=20)
    born: int = Field(ge=1000, le=2025)


class Book(BaseModel):  # nested: an enum, a list of objects ($defs / $ref), a list of strings, an optional
    title: str = Field(max_length=30)
    genre: Genre
    authors: list[Author] = Field(min_length=1, max_length=2)
    tags: list[Annotated[str, Field(max_length=12)]] = Field(max_length=3)
    year: int | None = Field(default=None, ge=0, le=2025)


class Lookup(BaseModel):  # tool arguments with a nested model
    city: str = Field(max_length=12)
    author: Author


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


def assert_declared(value: Any, shape: type[BaseModel], every: bool) -> None:
    """``value`` holds no key ``shape`` does not declare, at any depth (``every``: and each it declares)."""
    assert isinstance(value, dict), value
    keys, declared = set(value), set(shape.model_fields)
    assert keys == declared if every else keys <= declared, (keys, declared)
    for name, field in shape.model_fields.items():
        inner = get_args(field.annotation)[0] if get_origin(field.annotation) is list else field.annotation
        if name in value and isinstance(inner, type) and issubclass(inner, BaseModel):
            for item in value[name] if get_origin(field.annotation) is list else [value[name]]:
                assert_declared(item, inner, every)


def schema_format(shape: type[BaseModel], strict: bool | None) -> dict[str, Any]:
    return {"type": "json_schema",
            "json_schema": {"name": shape.__name__, "schema": shape.model_json_schema(), "strict": strict}}


def run_all(calls: list[Callable[[], Any]]) -> list[Any]:
    with ThreadPoolExecutor(len(calls)) as pool:
        return [f.result() for f in [pool.submit(c) for c in calls]]


def test_parse_nested_model_greedy_streamed_and_not(client: Any, model: str) -> None:
    """``chat.completions.parse`` and its streaming twin ``chat.completions.stream``."""
    kwargs = {"model": model, "messages": ask("Describe the book Moby Dick as JSON."),
              "response_format": Book, "temperature": 0, "max_tokens": 200}

    def streamed() -> Any:
        with client.chat.completions.stream(**kwargs) as stream:
            pieces = [e.delta for e in stream if e.type == "content.delta"]
            final = stream.get_final_completion()
        assert len(pieces) > 1  # really streamed in pieces
        return final

    whole, stream = run_all([lambda: client.chat.completions.parse(**kwargs), streamed])
    for result in (whole, stream):
        choice = result.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        assert isinstance(choice.message.parsed, Book)
        assert_declared(json.loads(choice.message.content), Book, every=True)
    assert stream.choices[0].message.content == whole.choices[0].message.content  # greedy: the same reply


@pytest.mark.parametrize("shape", [City, Book])
def test_pydantic_schema_as_is_strict_and_not(client: Any, model: str, shape: type[BaseModel]) -> None:
    """``model_json_schema()`` as the client sends it without ``parse()``, strict and not, streamed and not:
    every reply ends in ``stop`` and parses (strict: with every declared key, none other)."""
    prompt = "Tell me about Rome as JSON." if shape is City else "Describe the book Moby Dick as JSON."

    def one(strict: bool | None, stream: bool) -> tuple[str, str | None]:
        out = client.chat.completions.create(model=model, messages=ask(prompt), temperature=0, max_tokens=300,
                                             response_format=schema_format(shape, strict), stream=stream)
        if not stream:
            return out.choices[0].message.content, out.choices[0].finish_reason
        chunks = [c.choices[0] for c in out if c.choices]
        return "".join(c.delta.content or "" for c in chunks), chunks[-1].finish_reason

    cases = [(strict, stream) for strict in (True, None) for stream in (False, True)]
    replies = run_all([functools.partial(one, *case) for case in cases])
    for (strict, _), (text, finish) in zip(cases, replies, strict=True):
        assert finish == "stop", text
        shape.model_validate_json(text)
        assert_declared(json.loads(text), shape, every=strict is True)
    assert replies[0] == replies[1] and replies[2] == replies[3]  # streamed as not streamed


def test_strict_tool_with_nested_model(client: Any, model: str) -> None:
    """``openai.pydantic_function_tool`` (strict, ``$defs``): a named call parses into the model."""
    result = client.chat.completions.parse(
        model=model, messages=ask("Look up the author of Moby Dick in Boston."), temperature=0,
        max_tokens=120,
        tools=[openai.pydantic_function_tool(Lookup, name="lookup")],
        tool_choice={"type": "function", "function": {"name": "lookup"}})
    choice = result.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    assert call.function.name == "lookup" and isinstance(call.function.parsed_arguments, Lookup)
    assert_declared(json.loads(call.function.arguments), Lookup, every=True)


class Tagged(BaseModel):  # a free-form map: additionalProperties as a schema
    tags: dict[str, int]


def error_message(err: openai.BadRequestError) -> str:
    """The error body's own message (the exception's adds the status)."""
    assert isinstance(err.body, dict)
    return str(err.body["message"])


def test_strict_refusals_are_400s_naming_the_schema(client: Any, model: str) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.parse(model=model, messages=ask("Hi"), response_format=Tagged, max_tokens=5)
    assert err.value.status_code == 400 and err.value.type == "invalid_request_error"
    assert err.value.param == "response_format" and err.value.code == "invalid_json_schema"
    assert error_message(err.value).startswith(
        "Invalid schema for response_format 'Tagged': In context=('properties', 'tags'), 'additionalProp")
    tools = [openai.pydantic_function_tool(City), openai.pydantic_function_tool(Tagged)]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=model, messages=ask("Hi"), max_tokens=5, tools=tools)
    assert err.value.param == "tools[1].function.parameters"
    assert error_message(err.value).startswith("Invalid schema for function 'Tagged': "
                                               "In context=('properties', 'tags')")
    ok = client.chat.completions.create(model=model, messages=ask("Hi"), max_tokens=8, temperature=0,
                                        response_format=schema_format(Tagged, None))
    assert ok.choices[0].message.content.startswith('{"tags": {')  # not strict: the map is allowed

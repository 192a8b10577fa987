"""Which objects a JSON schema's grammar closes (``engine.grammar.close_objects``), strict and not, and how
the router turns ``strict`` and a schema strict mode cannot honour into a spec or a 400 (pure: no model)."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest

from engine.grammar import SchemaError, check, close_objects
from engine.sampling_params import StructuredOutput
from router.errors import APIError
from router.protocol import ChatCompletionRequest
from router.structured import structured_of
from router.tools import mode_of

INT = {"type": "integer"}
AB = {"a": INT, "b": INT}
CLOSED: dict[str, Any] = {"additionalProperties": False}
SUB = {"type": "object", "properties": {"x": INT}, "required": ["x"]}
CLOSED_SUB = {**SUB, "additionalProperties": False}


@pytest.mark.parametrize(("schema", "default", "strict"), [
    # silent about other keys: closed; strict also requires every declared key
    ({"type": "object", "properties": AB, "required": ["a"]},
     {"type": "object", "properties": AB, "required": ["a"], **CLOSED},
     {"type": "object", "properties": AB, "required": ["a", "b"], **CLOSED}),
    # nested through $defs, $ref, arrays and anyOf
    ({"$defs": {"S": SUB}, "properties": {"s": {"anyOf": [{"$ref": "#/$defs/S"}, {"type": "null"}]},
                                          "l": {"type": "array", "items": {"$ref": "#/$defs/S"}}}},
     {"$defs": {"S": CLOSED_SUB}, "properties": {"s": {"anyOf": [{"$ref": "#/$defs/S"}, {"type": "null"}]},
                                                 "l": {"type": "array", "items": {"$ref": "#/$defs/S"}}},
      "additionalProperties": False},
     {"$defs": {"S": CLOSED_SUB}, "properties": {"s": {"anyOf": [{"$ref": "#/$defs/S"}, {"type": "null"}]},
                                                 "l": {"type": "array", "items": {"$ref": "#/$defs/S"}}},
      "additionalProperties": False, "required": ["s", "l"]}),
    # a bare object: any object by default, strict the empty one
    ({"type": "object"}, {"type": "object"}, {"type": "object", **CLOSED, "required": []}),
    # an object that says other keys are allowed: kept by default (strict refuses it, below)
    ({"type": "object", "properties": {"a": INT}, "additionalProperties": True},
     {"type": "object", "properties": {"a": INT}, "additionalProperties": True}, None),
    # a required key the properties do not declare is an additional one: left open by default
    ({"properties": {"a": INT}, "required": ["z"]}, {"properties": {"a": INT}, "required": ["z"]}, None),
    # one object split over allOf: left open by default (closing each piece would forbid the other's key)
    ({"allOf": [{"$ref": "#/$defs/S"}, {"properties": {"y": INT}}], "$defs": {"S": SUB}},
     {"allOf": [{"$ref": "#/$defs/S"}, {"properties": {"y": INT}}], "$defs": {"S": SUB}}, None),
    # a lone $ref with a description is no split object
    ({"$defs": {"S": SUB}, "properties": {"s": {"$ref": "#/$defs/S", "description": "d"}}},
     {"$defs": {"S": CLOSED_SUB}, "properties": {"s": {"$ref": "#/$defs/S", "description": "d"}},
      "additionalProperties": False},
     {"$defs": {"S": CLOSED_SUB}, "properties": {"s": {"$ref": "#/$defs/S", "description": "d"}},
      "additionalProperties": False, "required": ["s"]}),
])
def test_close_objects(schema: dict[str, Any], default: dict[str, Any],
                       strict: dict[str, Any] | None) -> None:
    before = json.dumps(schema)
    assert close_objects(schema) == default
    if strict is not None:
        assert close_objects(schema, strict=True) == strict
        check(StructuredOutput("json_schema", json.dumps(strict)))
    check(StructuredOutput("json_schema", json.dumps(default)))
    assert json.dumps(schema) == before  # a copy: the request's schema is untouched


@pytest.mark.parametrize(("schema", "context", "keyword"), [
    ({"type": "object", "properties": {"a": INT}, "additionalProperties": True}, (), "additionalProperties"),
    ({"properties": {"tags": {"type": "object", "additionalProperties": {"type": "string"}}}},
     ("properties", "tags"), "additionalProperties"),
    ({"$defs": {"S": {"type": "object", "patternProperties": {"^x": INT}}}, "$ref": "#/$defs/S"},
     ("$defs", "S"), "patternProperties"),
    ({"properties": {"a": INT}, "required": ["a", "z"]}, (), "required"),
    ({"allOf": [{"$ref": "#/$defs/S"}, {"properties": {"y": INT}}], "$defs": {"S": SUB}}, (), "allOf"),
    ({"properties": {"p": {"$ref": "#/$defs/S", "properties": {"y": INT}}}, "$defs": {"S": SUB}},
     ("properties", "p"), "$ref"),
])
def test_strict_refuses_what_it_cannot_hold(schema: dict[str, Any], context: tuple[Any, ...],
                                            keyword: str) -> None:
    with pytest.raises(SchemaError) as err:
        close_objects(schema, strict=True)
    assert err.value.context == context
    assert str(err.value).startswith(f"In context={context}, '{keyword}'")


def chat(**body: object) -> ChatCompletionRequest:
    base = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **body}
    return msgspec.json.decode(json.dumps(base), type=ChatCompletionRequest)


def schema_format(schema: dict[str, Any], strict: bool | None) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "City", "schema": schema, "strict": strict}}


def test_response_format_strict_spec_and_key_order() -> None:
    city = {"type": "object", "properties": {"name": {"type": "string"}, "country": {"type": "string"},
                                             "is_capital": {"type": "boolean"}}, "required": ["name"]}
    strict = structured_of(chat(response_format=schema_format(city, True)))
    assert strict is not None and json.loads(strict.spec) == {
        **city, "required": ["name", "country", "is_capital"], "additionalProperties": False}
    loose = structured_of(chat(response_format=schema_format(city, None)))
    assert loose is not None and json.loads(loose.spec) == city  # the engine closes it when it builds
    assert list(json.loads(loose.spec)["properties"]) == ["name", "country", "is_capital"]  # declared order
    assert loose.key != strict.key


def test_response_format_strict_refusal_is_a_400_naming_it() -> None:
    schema = {"type": "object", "properties": {"tags": {"type": "object", "additionalProperties": INT}}}
    with pytest.raises(APIError) as err:
        structured_of(chat(response_format=schema_format(schema, True)))
    detail = err.value.detail
    assert err.value.status == 400 and detail.type == "invalid_request_error"
    assert detail.param == "response_format" and detail.code == "invalid_json_schema"
    assert detail.message == (
        "Invalid schema for response_format 'City': In context=('properties', 'tags'), "
        "'additionalProperties' admits undeclared properties, which strict mode forbids: "
        "leave it out or set it to false.")
    assert structured_of(chat(response_format=schema_format(schema, False))) is not None  # not strict


def tool(name: str, parameters: dict[str, Any], strict: bool | None = None) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": parameters, "strict": strict}}


@pytest.mark.parametrize("tool_choice", ["auto", "none", "required"])
def test_strict_tool_refusal_names_its_parameters_in_every_mode(tool_choice: str) -> None:
    tools = [tool("ok", SUB, strict=True), tool("bad", {**SUB, "additionalProperties": True}, strict=True)]
    with pytest.raises(APIError) as err:
        mode_of(chat(tools=tools, tool_choice=tool_choice))
    assert err.value.detail.param == "tools[1].function.parameters"
    assert err.value.detail.message.startswith("Invalid schema for function 'bad': In context=(), "
                                               "'additionalProperties'")
    tools[1] = tool("bad", {**SUB, "additionalProperties": True})  # not strict: honoured as written
    assert mode_of(chat(tools=tools, tool_choice=tool_choice)).tools


def test_tool_call_grammar_resolves_defs_of_the_arguments() -> None:
    """Arguments are a ``%json`` rule of their own, so a Pydantic-style ``$defs`` / ``$ref`` resolves."""
    params = {"$defs": {"S": SUB}, "type": "object", "properties": {"s": {"$ref": "#/$defs/S"}}}
    named = {"type": "function", "function": {"name": "f"}}
    for strict in (True, None):
        mode = mode_of(chat(tools=[tool("f", params, strict)], tool_choice=named))
        assert mode.grammar is not None
        check(mode.grammar)
        assert '"additionalProperties": false' in mode.grammar.spec
        assert ('"required": ["s"]' in mode.grammar.spec) is (strict is True)

"""Tool calling's pure parts: the call grammar, the prompt, parsing whole and streamed output."""

from __future__ import annotations

import json

import msgspec
import pytest

from engine.grammar import check
from router.errors import APIError
from router.protocol import ChatCompletionRequest
from router.tools import (
    CLOSE,
    OPEN,
    TOOLS_PROMPT,
    ParsedCall,
    ToolStream,
    call_chunks,
    conversation,
    mode_of,
    parse,
)

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CALL = OPEN + '{"name": "get_weather", "arguments": {"city": "Paris"}}' + CLOSE


def request(**body: object) -> ChatCompletionRequest:
    base = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **body}
    return msgspec.json.decode(json.dumps(base), type=ChatCompletionRequest)


def test_modes() -> None:
    assert mode_of(request()).render is False
    auto = mode_of(request(tools=[WEATHER]))
    assert auto.render and auto.parse and auto.grammar is None
    none = mode_of(request(tools=[WEATHER], tool_choice="none"))
    assert not none.render and not none.parse
    required = mode_of(request(tools=[WEATHER], tool_choice="required"))
    assert required.grammar is not None and required.grammar.kind == "lark"
    assert required.grammar.spec.startswith("start: call+")
    single = mode_of(request(tools=[WEATHER], tool_choice="required", parallel_tool_calls=False))
    assert single.grammar is not None and single.grammar.spec.startswith("start: call\n")
    check(single.grammar)  # a valid grammar
    named = {"type": "function", "function": {"name": "nope"}}
    with pytest.raises(APIError) as err:
        mode_of(request(tools=[WEATHER], tool_choice=named))
    assert err.value.detail.param == "tool_choice"
    with pytest.raises(APIError) as err:
        mode_of(request(tool_choice="required"))
    assert err.value.detail.param == "tool_choice"


def test_own_template_renders_tools_calls_and_results() -> None:
    req = request(tools=[WEATHER], messages=[
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "21C"}])
    messages, tools = conversation(req, mode_of(req), template_has_tools=False)
    assert tools is None
    assert messages[0]["role"] == "system" and messages[0]["content"].startswith(TOOLS_PROMPT.split("{")[0])
    assert '"name": "get_weather"' in messages[0]["content"]
    assert messages[2] == {"role": "assistant", "content": CALL}
    assert messages[3] == {"role": "tool", "content": "<tool_response>\n21C\n</tool_response>",
                           "tool_call_id": "c1"}
    messages, tools = conversation(req, mode_of(req), template_has_tools=True)
    assert tools is not None and tools[0]["function"]["name"] == "get_weather"
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}


def test_parse_whole_output() -> None:
    content, calls = parse("Sure. " + CALL + CALL, {"get_weather"})
    assert content == "Sure. "
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", '{"city": "Paris"}')] * 2
    assert calls[0].id != calls[1].id
    content, calls = parse(CALL, {"get_weather"})
    assert content is None and len(calls) == 1
    unknown = OPEN + '{"name": "other", "arguments": {}}' + CLOSE
    assert parse(unknown, {"get_weather"}) == (unknown, [])
    assert parse("no calls", {"get_weather"}) == ("no calls", [])


def test_stream_holds_back_a_partial_tag_and_splits_at_any_boundary() -> None:
    text = "Hi <b> " + CALL + " bye"
    for cut in range(1, len(text)):
        s = ToolStream({"get_weather"})
        events = s.feed(text[:cut]) + s.feed(text[cut:]) + s.flush()
        assert "".join(e for e in events if isinstance(e, str)) == "Hi <b>  bye"
        assert [e.name for e in events if isinstance(e, ParsedCall)] == ["get_weather"]
    s = ToolStream({"get_weather"})
    assert s.feed("a <tool_c") == ["a "]
    assert s.flush() == ["<tool_c"]  # an unfinished tag ends as text


def test_call_chunks_name_first_then_arguments_in_pieces() -> None:
    call = ParsedCall("get_weather", json.dumps({"city": "A very long city name indeed"}))
    chunks = call_chunks(call, 0)
    assert chunks[0] == {"index": 0, "id": call.id, "type": "function",
                         "function": {"name": "get_weather", "arguments": ""}}
    pieces = [c["function"]["arguments"] for c in chunks[1:]]  # type: ignore[index]
    assert len(pieces) > 1 and "".join(pieces) == call.arguments

"""Tool calling: tool definitions into the prompt, ``required`` / named calls enforced by a grammar, model
output parsed back into OpenAI ``tool_calls`` (whole, or streamed as ``delta.tool_calls``).

The call format is the one Hermes- and Qwen-style templates use, written compactly::

    <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>

Prompt: a chat template that reads a ``tools`` variable renders the definitions
itself (``tools`` is passed to it, and assistant ``tool_calls`` as HF's
``{"type": "function", "function": {"name", "arguments": <object>}}``).
Otherwise this module's own template is used: ``TOOLS_PROMPT`` with the
definitions is added to the system message (one is created first when the
conversation has none), an assistant message's calls are appended to its
content in the format above, and a ``tool`` message's content is wrapped in
``<tool_response>`` tags.

``tool_choice``: ``none`` leaves the tools out of the prompt and the output
unparsed; ``auto`` (the default when tools are given) renders them and parses
whatever calls the model writes; ``required`` and a named function also
constrain the output with a Lark grammar (per function: the name as a
constant, the arguments a ``%json`` rule of their own by the function's
``parameters`` schema, so its ``$defs`` and ``$ref`` resolve as written; compact
JSON as ``engine.grammar.JSON_OPTIONS`` writes it) to one call,
or one or more when ``parallel_tool_calls`` is true (the default).

The arguments' schema is the function's ``parameters`` with its objects closed
(``engine.grammar.close_objects``): undeclared keys are not admitted where the
schema is silent about them, and with ``function.strict`` true every object
admits exactly its declared properties, all required. A strict function whose
``parameters`` cannot be held to that (or is no valid schema) is a 400 naming
``tools[i].function.parameters``, whatever ``tool_choice`` says; under ``auto``
the calls the model writes are parsed, not constrained.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.grammar import JSON_OPTIONS, GrammarError, check, close_objects, lark_string
from engine.sampling_params import StructuredOutput
from router.errors import invalid
from router.protocol import ChatCompletionRequest, ChatMessage, NamedToolChoice, Tool

OPEN, CLOSE = "<tool_call>", "</tool_call>"
TOOLS_PROMPT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n"
    "<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>{{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}}</tool_call>"
)
ARGUMENT_PIECE = 16  # characters of arguments per streamed chunk


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text of an object
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])

    def openai(self) -> dict[str, object]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ToolMode:
    """What a chat request does with its tools: ``render`` them in the prompt, ``parse`` the output."""

    tools: tuple[Tool, ...]
    render: bool
    parse: bool
    grammar: StructuredOutput | None

    @property
    def names(self) -> set[str]:
        return {t.function.name for t in self.tools}


def mode_of(req: ChatCompletionRequest) -> ToolMode:
    """The request's tool mode; a contradictory request is a 400 naming the field."""
    tools = tuple(req.tools or ())
    choice = req.tool_choice
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise invalid("'tools' names must be unique.", "tools")
    calls = [(t, arguments_schema(t, i)) for i, t in enumerate(tools)]
    if not tools:
        if choice not in (None, "none"):
            raise invalid("'tool_choice' needs 'tools'.", "tool_choice")
        if req.parallel_tool_calls is not None:
            raise invalid("'parallel_tool_calls' needs 'tools'.", "parallel_tool_calls")
        return ToolMode((), False, False, None)
    if choice == "none":
        return ToolMode(tools, False, False, None)
    if choice in (None, "auto"):
        return ToolMode(tools, True, True, None)
    if isinstance(choice, NamedToolChoice):
        chosen = [(t, a) for t, a in calls if t.function.name == choice.function.name]
        if not chosen:
            raise invalid(f"'tool_choice' names {choice.function.name!r}, which is not in 'tools'.",
                          "tool_choice")
        grammar = call_grammar(chosen, many=False)
    else:
        grammar = call_grammar(calls, many=req.parallel_tool_calls is not False)
    if req.response_format is not None and req.response_format.type != "text":
        raise invalid("'response_format' cannot be combined with a required tool call.", "response_format")
    return ToolMode(tools, True, True, grammar)


def arguments_schema(tool: Tool, index: int) -> dict[str, Any]:
    """The schema ``tool``'s call arguments follow: its ``parameters`` (an empty object when none) with their
    objects closed, strictly when ``function.strict``; a strict one is checked whole. A 400 naming
    ``tools[index].function.parameters`` when it cannot be held to that."""
    params = tool.function.parameters or {"type": "object", "properties": {}}
    strict = tool.function.strict is True
    param = f"tools[{index}].function.parameters"
    try:
        closed = close_objects(params, strict=strict)
        if strict:
            check(StructuredOutput("json_schema", json.dumps(closed)))
    except GrammarError as exc:
        raise invalid(f"Invalid schema for function '{tool.function.name}': {exc}", param,
                      code="invalid_json_schema") from None
    return closed


def call_grammar(tools: Sequence[tuple[Tool, dict[str, Any]]], many: bool) -> StructuredOutput:
    """A Lark grammar: one tool call (``many``: one or more) of any of ``tools`` (each with its
    ``arguments_schema``), and nothing else."""
    rules = []
    for i, (tool, schema) in enumerate(tools):
        head = lark_string('{"name": ' + json.dumps(tool.function.name) + ', "arguments": ')
        args = {**schema, "x-guidance": JSON_OPTIONS}
        rules += [f"fn{i}: {head} args{i} {lark_string('}')}", f"args{i}: %json {json.dumps(args)}"]
    alternatives = " | ".join(f"fn{i}" for i in range(len(tools)))
    start = "start: call+" if many else "start: call"
    lark = "\n".join([start, f"call: {json.dumps(OPEN)} ({alternatives}) {json.dumps(CLOSE)}", *rules])
    return StructuredOutput("lark", lark)


def _definitions(tools: Sequence[Tool]) -> list[dict[str, Any]]:
    out = []
    for t in tools:
        fn: dict[str, Any] = {"name": t.function.name}
        if t.function.description is not None:
            fn["description"] = t.function.description
        fn["parameters"] = t.function.parameters or {"type": "object", "properties": {}}
        out.append({"type": "function", "function": fn})
    return out


def _call_text(name: str, arguments: str) -> str:
    try:
        args = json.loads(arguments)
    except ValueError:
        raise invalid(f"tool call arguments of {name!r} in 'messages' are not JSON.", "messages") from None
    return OPEN + json.dumps({"name": name, "arguments": args}) + CLOSE


def conversation(req: ChatCompletionRequest, mode: ToolMode, template_has_tools: bool
                 ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The messages (and the ``tools`` argument) to hand the chat template."""
    own = not template_has_tools
    messages: list[dict[str, Any]] = [_message(m, own) for m in req.messages]
    if not mode.render:
        return messages, None
    if template_has_tools:
        return messages, _definitions(mode.tools)
    block = TOOLS_PROMPT.format(tools="\n".join(json.dumps(d) for d in _definitions(mode.tools)))
    if messages and messages[0]["role"] in ("system", "developer"):
        messages[0] = {**messages[0], "content": f"{messages[0]['content']}\n\n{block}"}
    else:
        messages.insert(0, {"role": "system", "content": block})
    return messages, None


def _message(m: ChatMessage, own_template: bool) -> dict[str, Any]:
    text = m.text()
    if m.role == "tool":
        if m.tool_call_id is None:
            raise invalid("a 'tool' message needs 'tool_call_id'.", "messages")
        return {"role": "tool", "content": f"<tool_response>\n{text}\n</tool_response>" if own_template
                else text, "tool_call_id": m.tool_call_id}
    if not m.tool_calls:
        return {"role": m.role, "content": text}
    if m.role != "assistant":
        raise invalid("only assistant messages may hold 'tool_calls'.", "messages")
    if own_template:
        calls_text = "".join(_call_text(c.function.name, c.function.arguments) for c in m.tool_calls)
        return {"role": "assistant", "content": text + calls_text}
    calls = [{"id": c.id, "type": "function",
              "function": {"name": c.function.name, "arguments": json.loads(c.function.arguments)}}
             for c in m.tool_calls]
    return {"role": "assistant", "content": text, "tool_calls": calls}


def _parse_call(body: str, names: set[str]) -> ParsedCall | None:
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if not isinstance(args, dict):
        return None
    return ParsedCall(str(obj["name"]), json.dumps(args))


def parse(text: str, names: set[str]) -> tuple[str | None, list[ParsedCall]]:
    """The content left once every well-formed call is taken out (None when nothing is left), and the
    calls in order. A ``<tool_call>`` block that does not parse, or names no given tool, stays text."""
    stream = ToolStream(names)
    events = stream.feed(text) + stream.flush()
    content = "".join(e for e in events if isinstance(e, str))
    calls = [e for e in events if isinstance(e, ParsedCall)]
    return (content if content.strip() or not calls else None), calls


class ToolStream:
    """Splits a choice's streamed text into content pieces and complete calls.

    ``feed`` returns content that can no longer be part of a call (text that
    could still grow into ``<tool_call>`` is held back) and each call once its
    ``</tool_call>`` arrives; ``flush`` (at the end) returns what was held,
    an unfinished call as plain text.
    """

    def __init__(self, names: set[str]) -> None:
        self.names = names
        self._buf = ""
        self.calls = 0

    def feed(self, text: str) -> list[str | ParsedCall]:
        self._buf += text
        out: list[str | ParsedCall] = []
        while True:
            start = self._buf.find(OPEN)
            if start < 0:
                keep = _partial_suffix(self._buf, OPEN)
                if len(self._buf) > keep:
                    out.append(self._buf[:len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep:]
                return out
            end = self._buf.find(CLOSE, start)
            if end < 0:
                if start:
                    out.append(self._buf[:start])
                    self._buf = self._buf[start:]
                return out
            body = self._buf[start + len(OPEN):end]
            call = _parse_call(body.strip(), self.names)
            if start:
                out.append(self._buf[:start])
            if call is None:
                out.append(self._buf[start:end + len(CLOSE)])
            else:
                self.calls += 1
                out.append(call)
            self._buf = self._buf[end + len(CLOSE):]

    def flush(self) -> list[str | ParsedCall]:
        rest, self._buf = self._buf, ""
        return [rest] if rest else []


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for k in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


def call_chunks(call: ParsedCall, index: int) -> list[dict[str, object]]:
    """``delta.tool_calls`` entries for one call: id, type and name (empty arguments) first, then the
    arguments in pieces of ``ARGUMENT_PIECE`` characters."""
    first: dict[str, object] = {"index": index, "id": call.id, "type": "function",
                                "function": {"name": call.name, "arguments": ""}}
    pieces = [call.arguments[i:i + ARGUMENT_PIECE] for i in range(0, len(call.arguments), ARGUMENT_PIECE)]
    return [first] + [{"index": index, "function": {"arguments": p}} for p in pieces]

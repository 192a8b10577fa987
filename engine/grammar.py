"""From a ``StructuredOutput`` to an llguidance grammar, and its tokenizer-free validation.

llguidance rather than xgrammar (both tried on this tokenizer): it needs no torch, triton or
TVM runtime, so the router validates a spec without loading either; its grammars are lazy, so
a large schema costs milliseconds to "compile"; Lark with embedded ``%json`` expresses tool calls
directly; and its masks cost well under a millisecond per row. xgrammar computes a mask faster,
but either is far below the step's other costs.

Pure Python over llguidance (no torch, no tokenizer), so the router can refuse a
bad schema with a 400 before any worker sees it, and the workers build exactly
the same grammar text from the same spec.

Kinds (``engine.sampling_params.STRUCTURED_KINDS``):

* ``json_schema``: ``spec`` is a JSON schema (JSON text); whitespace between
  JSON tokens is limited to single spaces, so a small model cannot spin in
  newlines.
* ``json_object``: any JSON object.
* ``regex``: ``spec`` is a regular expression the whole output matches.
* ``choice``: ``spec`` is a JSON list of strings; the output is exactly one.
* ``lark``: ``spec`` is a Lark grammar in llguidance's dialect (``%json {...}``
  embeds a JSON schema; tool calls use it).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import llguidance

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

from engine.sampling_params import StructuredOutput

# compact JSON: no newlines or indentation between tokens, single spaces after ',' and ':'
JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False, "item_separator": ", ",
                                    "key_separator": ": ", "whitespace_pattern": None}


class GrammarError(ValueError):
    """The spec is not a grammar llguidance accepts; the message says why."""


def json_schema_grammar(schema: dict[str, Any] | bool) -> str:
    """An llguidance grammar for ``schema`` (compact JSON separators)."""
    if isinstance(schema, bool):
        schema = {} if schema else {"not": {}}
    return str(llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS))


def lark_string(text: str) -> str:
    """``text`` as a Lark string literal."""
    return json.dumps(text)


def build(so: StructuredOutput) -> str:
    """The grammar text of ``so``; raises GrammarError when the spec is not well formed."""
    if so.kind == "json_object":
        return json_schema_grammar({"type": "object"})
    if so.kind == "json_schema":
        try:
            schema = json.loads(so.spec)
        except ValueError as exc:
            raise GrammarError(f"the schema is not valid JSON: {exc}") from None
        if not isinstance(schema, (dict, bool)):
            raise GrammarError("the schema must be a JSON object")
        return json_schema_grammar(schema)
    if so.kind == "regex":
        return str(llguidance.LLMatcher.grammar_from_regex(so.spec))
    if so.kind == "choice":
        try:
            choices = json.loads(so.spec)
        except ValueError:
            choices = None
        if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
            raise GrammarError("choices must be a non-empty list of strings")
        return str(llguidance.LLMatcher.grammar_from_lark(
            "start: " + " | ".join(lark_string(c) for c in choices)))
    if so.kind == "lark":
        return str(llguidance.LLMatcher.grammar_from_lark(so.spec))
    raise GrammarError(f"unknown kind {so.kind!r}")


def check(so: StructuredOutput) -> str:
    """Build and validate ``so`` without a tokenizer; returns the grammar, raises GrammarError."""
    grammar = build(so)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise GrammarError((messages[0] if messages else "invalid grammar").strip())
    return grammar

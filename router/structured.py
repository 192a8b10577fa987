"""The output constraint a request asks for, as the engine's ``StructuredOutput``, checked before any
worker sees it.

Sources, at most one per request (a second is a 400 naming it):

* OpenAI's ``response_format``: ``text`` (no constraint), ``json_object`` (any
  JSON object), ``json_schema`` (``json_schema.schema``, always enforced; with
  ``json_schema.strict`` true, every object admits exactly its declared
  properties, all required: ``engine.grammar.close_objects``, and a schema
  that cannot be held to that is a 400 naming ``response_format``);
* vLLM's ``structured_outputs`` object (``json``, ``regex``, ``choice``,
  ``grammar``, ``json_object``) and its older ``guided_json``,
  ``guided_regex``, ``guided_choice``, ``guided_grammar`` fields.

A grammar (``guided_grammar``, ``structured_outputs.grammar``) is Lark in
llguidance's dialect; a GBNF grammar (rules written ``name ::= ...``) is
converted to it. A spec llguidance refuses (an invalid schema, regex or
grammar) is a 400 naming the field it came from.

Without ``strict`` a JSON schema keeps JSON Schema's meaning except where it
is silent about undeclared keys: there, as vLLM's default backend does, they
are not admitted (``engine.grammar``). The schema's text keeps the request's
key order, so properties are written in the order the schema declares them.
"""

from __future__ import annotations

import json

from llguidance.gbnf_to_lark import gbnf_to_lark

from engine.grammar import GrammarError, SchemaError, check, close_objects
from engine.sampling_params import StructuredOutput
from router.errors import invalid
from router.protocol import CompletionParams


def _json_spec(schema: object, param: str, strict_name: str | None = None) -> StructuredOutput:
    """``strict_name``: the ``json_schema.name`` of a strict ``response_format`` (None: not strict)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise invalid(f"'{param}' is not valid JSON: {exc}.", param) from None
    if not isinstance(schema, (dict, bool)):
        raise invalid(f"'{param}' must be a JSON schema object.", param)
    if strict_name is not None:
        try:
            schema = close_objects(schema, strict=True)
        except SchemaError as exc:
            raise invalid(f"Invalid schema for {param} '{strict_name}': {exc}", param,
                          code="invalid_json_schema") from None
    return StructuredOutput("json_schema", json.dumps(schema))


def _grammar_spec(grammar: str, param: str) -> StructuredOutput:
    if "::=" in grammar:
        try:
            grammar = gbnf_to_lark(grammar)
        except Exception as exc:  # the converter raises plain exceptions on bad input
            raise invalid(f"'{param}' is not a valid GBNF grammar: {exc}.", param) from None
    return StructuredOutput("lark", grammar)


def _sources(req: CompletionParams) -> list[tuple[str, StructuredOutput]]:
    found: list[tuple[str, StructuredOutput]] = []
    rf = req.response_format
    if rf is not None and rf.type == "json_object":
        found.append(("response_format", StructuredOutput("json_object")))
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.schema is None:
            raise invalid("'response_format' of type json_schema needs 'json_schema.schema'.",
                          "response_format")
        strict_name = rf.json_schema.name if rf.json_schema.strict else None
        found.append(("response_format", _json_spec(rf.json_schema.schema, "response_format", strict_name)))
    if req.guided_json is not None:
        found.append(("guided_json", _json_spec(req.guided_json, "guided_json")))
    if req.guided_regex is not None:
        found.append(("guided_regex", StructuredOutput("regex", req.guided_regex)))
    if req.guided_choice is not None:
        found.append(("guided_choice", StructuredOutput("choice", json.dumps(req.guided_choice))))
    if req.guided_grammar is not None:
        found.append(("guided_grammar", _grammar_spec(req.guided_grammar, "guided_grammar")))
    so = req.structured_outputs
    if so is not None:
        param = "structured_outputs"
        if so.json is not None:
            found.append((param, _json_spec(so.json, param)))
        if so.regex is not None:
            found.append((param, StructuredOutput("regex", so.regex)))
        if so.choice is not None:
            found.append((param, StructuredOutput("choice", json.dumps(so.choice))))
        if so.grammar is not None:
            found.append((param, _grammar_spec(so.grammar, param)))
        if so.json_object:
            found.append((param, StructuredOutput("json_object")))
    return found


def structured_of(req: CompletionParams) -> StructuredOutput | None:
    """The request's checked constraint, or None; raises a 400 APIError naming the field."""
    found = _sources(req)
    if len(found) > 1:
        first, second = found[0][0], found[1][0]
        raise invalid(f"'{second}' cannot be combined with '{first}': give one output constraint.", second)
    if not found:
        return None
    param, spec = found[0]
    try:
        check(spec)
    except GrammarError as exc:
        raise invalid(f"Invalid '{param}': {exc}", param, code="invalid_grammar") from None
    return spec

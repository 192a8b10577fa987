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
  newlines. Its objects are closed first (``close_objects``, not strict).
* ``json_object``: any JSON object.
* ``regex``: ``spec`` is a regular expression the whole output matches.
* ``choice``: ``spec`` is a JSON list of strings; the output is exactly one.
* ``lark``: ``spec`` is a Lark grammar in llguidance's dialect (``%json {...}``
  embeds a JSON schema; tool calls use it).

Closing objects (``close_objects``): JSON Schema lets an object hold keys its ``properties`` do not
declare unless ``additionalProperties`` forbids them, and generated schemas (Pydantic's among them)
rarely do, so a constrained model may invent keys until it runs out of tokens. vLLM's default backend
(xgrammar's ``strict_mode``) forbids them where the schema is silent, and so does this module:

* default: an object schema that declares ``properties`` (or ``patternProperties``) and says nothing of
  ``additionalProperties`` / ``unevaluatedProperties`` admits only those keys; what ``required`` says
  is kept. An explicit ``additionalProperties`` (``true`` or a schema) is honoured. An object whose
  keys are split over several schemas intersected together (``allOf``, ``$ref`` beside object
  keywords, ``anyOf`` / ``oneOf`` beside an object's own keywords) is left open: closing each piece on
  its own keys would forbid the others' (llguidance has no ``unevaluatedProperties``).
* strict (OpenAI's ``strict: true``): every object schema (``properties`` or ``type: object``, at any
  depth, ``$defs`` included) admits exactly its declared properties, all of them required. A schema
  that cannot be held to that is refused with ``SchemaError``: ``additionalProperties`` other than
  false, ``patternProperties``, ``unevaluatedProperties`` other than false, ``required`` naming an
  undeclared property, or an object split over several schemas as above.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, overload
from urllib.parse import unquote

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

from engine.sampling_params import StructuredOutput

# compact JSON: no newlines or indentation between tokens, single spaces after ',' and ':'
JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False, "item_separator": ", ",
                                    "key_separator": ": ", "whitespace_pattern": None}


class GrammarError(ValueError):
    """The spec is not a grammar llguidance accepts; the message says why."""


class SchemaError(GrammarError):
    """A schema strict mode cannot honour; ``context`` is the path of keys to the object at fault."""

    def __init__(self, context: tuple[str | int, ...], message: str) -> None:
        super().__init__(f"In context={context}, {message}")
        self.context = context


# keywords whose value is a map of name -> schema, a schema, or a list of schemas
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_VALUES = ("additionalProperties", "unevaluatedProperties", "propertyNames", "items",
                  "additionalItems", "unevaluatedItems", "contains", "not", "if", "then", "else")
_SCHEMA_LISTS = ("prefixItems", "items", "allOf", "anyOf", "oneOf")
# keywords that say which keys an object holds
_KEY_KEYWORDS = frozenset({"properties", "patternProperties", "additionalProperties", "unevaluatedProperties",
                           "required", "dependentRequired", "dependentSchemas", "propertyNames"})

Schema = dict[str, Any]
Path = tuple[str | int, ...]


def subschemas(node: Schema, path: Path = ()) -> Iterator[tuple[Schema, Path]]:
    """Every schema object inside ``node`` (not ``node`` itself), depth first, with its path of keys."""
    for key in _SCHEMA_MAPS:
        value = node.get(key)
        if isinstance(value, dict):
            for name, sub in value.items():
                yield from _with_children(sub, (*path, key, name))
    for key in _SCHEMA_VALUES:
        yield from _with_children(node.get(key), (*path, key))
    for key in _SCHEMA_LISTS:
        value = node.get(key)
        if isinstance(value, list):
            for i, sub in enumerate(value):
                yield from _with_children(sub, (*path, key, i))


def _with_children(node: object, path: Path) -> Iterator[tuple[Schema, Path]]:
    if isinstance(node, dict):
        yield node, path
        yield from subschemas(node, path)


def _list(node: Schema, key: str) -> list[Any]:
    value = node.get(key)
    return value if isinstance(value, list) else []


def _types(node: Schema) -> set[str]:
    t = node.get("type")
    if isinstance(t, str):
        return {t}
    return {x for x in t if isinstance(x, str)} if isinstance(t, list) else set()


class _Closer:
    """``close_objects`` over one copy of a schema."""

    def __init__(self, root: Schema, strict: bool) -> None:
        self.root = root
        self.strict = strict

    def closable(self, node: Schema) -> bool:
        """Whether this node gets ``additionalProperties: false`` (and, strict, all keys required). Not
        strict, a node whose ``required`` names an undeclared key stays open: that key is an additional
        one."""
        if self.strict:
            return isinstance(node.get("properties"), dict) or "object" in _types(node)
        declared = node.get("properties")
        if not isinstance(declared, dict) and not isinstance(node.get("patternProperties"), dict):
            return False
        required = _list(node, "required")
        return "additionalProperties" not in node and "unevaluatedProperties" not in node \
            and not (isinstance(node.get("patternProperties"), dict) and required) \
            and all(isinstance(declared, dict) and k in declared for k in required)

    def resolve(self, ref: object) -> Schema | None:
        """The node a local ``$ref`` (``#`` or ``#/a/b``) points at, or None."""
        if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
            return None
        node: object = self.root
        for raw in ref[2:].split("/") if ref != "#" else ():
            key = unquote(raw).replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict):
                node = node.get(key)
            elif isinstance(node, list) and key.isdigit() and int(key) < len(node):
                node = node[int(key)]
            else:
                return None
        return node if isinstance(node, dict) else None

    def pieces(self, node: Schema, seen: set[int]) -> list[Schema]:
        """The schemas that hold keys of the one object ``node`` describes once intersected: ``node``
        itself, then through ``allOf``, ``$ref``, ``anyOf`` and ``oneOf``."""
        if id(node) in seen:
            return []
        seen.add(id(node))
        found = [node] if _KEY_KEYWORDS & node.keys() or self.closable(node) else []
        parts = [*_list(node, "allOf"), self.resolve(node.get("$ref")), *_list(node, "anyOf"),
                 *_list(node, "oneOf")]
        for part in parts:
            if isinstance(part, dict):
                found += self.pieces(part, seen)
        return found

    def composed(self, node: Schema) -> list[Schema]:
        """The key-holding schemas intersected at ``node`` (its own keywords, ``allOf``, ``$ref``; and its
        ``anyOf`` / ``oneOf`` branches when one of those holds keys): more than one, with one closable,
        is an object split over several schemas."""
        seen = {id(node)}
        own = [node] if _KEY_KEYWORDS & node.keys() or self.closable(node) else []
        for part in [*_list(node, "allOf"), self.resolve(node.get("$ref"))]:
            if isinstance(part, dict):
                own += self.pieces(part, seen)
        if own:
            for part in [*_list(node, "anyOf"), *_list(node, "oneOf")]:
                if isinstance(part, dict):
                    own += self.pieces(part, seen)
        return own if len(own) > 1 and any(self.closable(p) for p in own) else []

    def run(self) -> Schema:
        nodes = [(self.root, ()), *subschemas(self.root)]
        left_open: set[int] = set()
        for node, path in nodes:
            split = self.composed(node)
            if split and self.strict:
                keyword = next((k for k in ("allOf", "$ref", "anyOf", "oneOf") if k in node), "allOf")
                raise SchemaError(path, f"'{keyword}' splits one object over several schemas, which strict "
                                        "mode cannot hold to exactly its declared properties; declare the "
                                        "object in one schema.")
            left_open.update(id(p) for p in split)
        for node, path in nodes:
            if self.strict:
                _refuse_open(node, path)
            if id(node) not in left_open and self.closable(node):
                self.close(node)
        return self.root

    def close(self, node: Schema) -> None:
        node["additionalProperties"] = False
        if self.strict:
            node["required"] = list(node.get("properties", {}))


def _refuse_open(node: Schema, path: Path) -> None:
    """Strict: a node that admits undeclared keys, or requires one, is a SchemaError."""
    for keyword, allowed in (("additionalProperties", False), ("unevaluatedProperties", False),
                             ("patternProperties", {})):
        if node.get(keyword, allowed) != allowed:
            raise SchemaError(path, f"'{keyword}' admits undeclared properties, which strict mode forbids: "
                                    f"leave it out or set it to {json.dumps(allowed)}.")
    declared = node.get("properties", {})
    stray = [k for k in _list(node, "required") if not isinstance(declared, dict) or k not in declared]
    if stray:
        raise SchemaError(path, f"'required' names {stray[0]!r}, which 'properties' does not declare.")


@overload
def close_objects(schema: Schema, strict: bool = False) -> Schema: ...


@overload
def close_objects(schema: bool, strict: bool = False) -> bool: ...


def close_objects(schema: Schema | bool, strict: bool = False) -> Schema | bool:
    """A copy of ``schema`` whose objects admit only their declared properties (see the module's
    docstring for what ``strict`` adds); raises SchemaError (strict only)."""
    if isinstance(schema, bool):
        return schema
    return _Closer(copy.deepcopy(schema), strict).run()


def _matcher() -> Any:
    """llguidance's ``LLMatcher``, imported on first use: an engine serving no grammar never loads it."""
    import llguidance

    return llguidance.LLMatcher


def json_schema_grammar(schema: dict[str, Any] | bool) -> str:
    """An llguidance grammar for ``schema`` (compact JSON separators)."""
    if isinstance(schema, bool):
        schema = {} if schema else {"not": {}}
    return str(_matcher().grammar_from_json_schema(schema, defaults=JSON_OPTIONS))


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
        return json_schema_grammar(close_objects(schema))
    if so.kind == "regex":
        return str(_matcher().grammar_from_regex(so.spec))
    if so.kind == "choice":
        try:
            choices = json.loads(so.spec)
        except ValueError:
            choices = None
        if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
            raise GrammarError("choices must be a non-empty list of strings")
        return str(_matcher().grammar_from_lark(
            "start: " + " | ".join(lark_string(c) for c in choices)))
    if so.kind == "lark":
        return str(_matcher().grammar_from_lark(so.spec))
    raise GrammarError(f"unknown kind {so.kind!r}")


def check(so: StructuredOutput) -> str:
    """Build and validate ``so`` without a tokenizer; returns the grammar, raises GrammarError."""
    grammar = build(so)
    is_error, messages = _matcher().validate_grammar_with_warnings(grammar)
    if is_error:
        raise GrammarError((messages[0] if messages else "invalid grammar").strip())
    return grammar

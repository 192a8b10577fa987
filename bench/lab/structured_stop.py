"""How often schema-constrained replies end: the share of greedy replies to JSON-schema requests that end
in ``stop`` (not ``length``), parse, and hold no key their schema does not declare.

The schemas are written as Pydantic writes them (no ``additionalProperties``), the way most clients
send them: a city (the strings and a flag), a book (a nested author, an enum, a list) and a scientist (a
list of strings). Each is asked of ``--subjects`` subjects through the engine's chat template, greedy,
``--max-tokens`` at most. An engine that lets undeclared keys through writes invented keys until the
token limit; one that closes the schema's objects stops when they are complete.

    python -m bench.lab.structured_stop [--model PATH] [--max-tokens 300] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from engine import LLM, SamplingParams
from engine.sampling_params import StructuredOutput

SCHEMAS: dict[str, tuple[dict[str, Any], str]] = {
    "city": ({"title": "City", "type": "object", "required": ["name", "country", "is_capital"],
              "properties": {"name": {"type": "string", "maxLength": 40},
                             "country": {"type": "string", "maxLength": 40},
                             "is_capital": {"type": "boolean"}}},
             "Tell me about {} as JSON."),
    "book": ({"title": "Book", "type": "object", "required": ["title", "author", "genre", "tags"],
              "$defs": {"Author": {"title": "Author", "type": "object", "required": ["name", "born"],
                                   "properties": {"name": {"type": "string"}, "born": {"type": "integer"}}},
                        "Genre": {"enum": ["fiction", "history", "science"], "type": "string"}},
              "properties": {"title": {"type": "string"}, "author": {"$ref": "#/$defs/Author"},
                             "genre": {"$ref": "#/$defs/Genre"},
                             "tags": {"type": "array", "items": {"type": "string"}}}},
             "Describe a famous book about {} as JSON."),
    "scientist": ({"title": "Scientist", "type": "object", "required": ["name", "field", "languages"],
                   "properties": {"name": {"type": "string"}, "field": {"type": "string"},
                                  "languages": {"type": "array", "items": {"type": "string"}}}},
                  "Describe a famous scientist from {} as JSON."),
}
SUBJECTS = ["Rome", "Paris", "Tokyo", "Cairo", "Lima", "Oslo", "Delhi", "Quebec"]


def declared(schema: dict[str, Any], value: Any, defs: dict[str, Any] | None = None) -> bool:
    """Whether every object in ``value`` holds only the keys its (sub)schema declares."""
    defs = schema.get("$defs", {}) if defs is None else defs
    if "$ref" in schema:
        return declared(defs[schema["$ref"].rsplit("/", 1)[-1]], value, defs)
    if isinstance(value, dict):
        props = schema.get("properties", {})
        return set(value) <= set(props) and all(declared(props[k], v, defs) for k, v in value.items())
    if isinstance(value, list):
        return all(declared(schema.get("items", {}), v, defs) for v in value)
    return True


def run(llm: LLM, max_tokens: int, subjects: int) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for name, (schema, ask) in SCHEMAS.items():
        constraint = StructuredOutput("json_schema", json.dumps(schema))
        prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": ask.format(s)}])
                   for s in SUBJECTS[:subjects]]
        replies = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                       structured=constraint))
        stop = parsed = clean = 0
        for reply in replies:
            stop += reply.finish_reason == "stop"
            try:
                value = json.loads(reply.text)
            except json.JSONDecodeError:
                continue
            parsed += 1
            clean += declared(schema, value)
        n = len(replies)
        out[name] = {"replies": n, "stop": stop / n, "parsed": parsed / n, "declared_keys_only": clean / n,
                     "mean_chars": sum(len(r.text) for r in replies) / n}
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.lab.structured_stop",
                                description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--model", default=None, help="model path (default: the built-in SmolLM2-135M)")
    p.add_argument("--max-tokens", type=int, default=300)
    p.add_argument("--subjects", type=int, default=len(SUBJECTS),
                   help=f"prompts per schema (at most {len(SUBJECTS)})")
    p.add_argument("--json", default=None, metavar="OUT", help="also write the results as JSON")
    args = p.parse_args(argv)
    results = run(LLM(args.model), args.max_tokens, args.subjects)
    for name, r in results.items():
        print(f"{name:10s} {r['replies']:3.0f} replies: stop {100 * r['stop']:5.1f}%  "
              f"parsed {100 * r['parsed']:5.1f}%  declared keys only {100 * r['declared_keys_only']:5.1f}%  "
              f"mean {r['mean_chars']:.0f} chars")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()

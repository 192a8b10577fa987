"""Grammar-constrained decoding in the engine, on the default SmolLM2 model (its real tokenizer).

One engine serves the module. Every constrained output is checked against its grammar (JSON parsed and
validated against the schema, regexes matched in full, choices compared), and every path that carries a
guide's state (the decode side's first token, a migrated continuation, preemption, rollback) is compared
token for token against an uninterrupted run.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import pytest
import torch

from engine.grammar import GrammarError, SchemaError, check, close_objects
from engine.llm import LLM
from engine.sampling_params import SamplingParams, StructuredOutput
from engine.structured import MAX_ROLLBACK, unpack_bitmask

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "pets": {"type": "array", "items": {"enum": ["cat", "dog"]}, "maxItems": 2},
}, "required": ["name", "age", "pets"], "additionalProperties": False}
JSON_SO = StructuredOutput("json_schema", json.dumps(SCHEMA))


@pytest.fixture(scope="module")
def llm(default_model_path: Path) -> Iterator[LLM]:
    yield LLM(str(default_model_path), num_kv_blocks=64, block_size=16)


def _prompt(llm: LLM, text: str) -> list[int]:
    return llm.tokenizer.apply_chat_template([{"role": "user", "content": text}])


def _text(llm: LLM, ids: list[int]) -> str:
    return llm.tokenizer.decode(ids)


@pytest.mark.parametrize(("so", "error"), [
    (StructuredOutput("json_schema", '{"type": "nonsense"}'), "nonsense"),
    (StructuredOutput("json_schema", "{not json"), "not valid JSON"),
    (StructuredOutput("json_schema", "[1, 2]"), "must be a JSON object"),
    (StructuredOutput("regex", "(("), "unclosed group"),
    (StructuredOutput("choice", "[]"), "non-empty list"),
    (StructuredOutput("lark", "start: missing_rule"), "missing_rule"),
])
def test_bad_grammars_are_refused_without_a_tokenizer(so: StructuredOutput, error: str) -> None:
    with pytest.raises(GrammarError, match=re.escape(error)):
        check(so)


def test_bad_kind_is_refused_by_sampling_params() -> None:
    with pytest.raises(ValueError, match="structured.kind"):
        StructuredOutput("yaml")


def test_unpack_bitmask_bit_order() -> None:
    mask = torch.tensor([[0b101, -(1 << 31)], [0, 1]], dtype=torch.int32)  # bit 31 set: token 63
    allowed = unpack_bitmask(mask, 64)
    assert allowed[0].nonzero().flatten().tolist() == [0, 2, 63]
    assert allowed[1].nonzero().flatten().tolist() == [32]
    assert unpack_bitmask(mask, 70)[:, 64:].any().item() is False  # past the mask's width: not allowed


def test_json_schema_output_is_valid_greedy_and_sampled(llm: LLM) -> None:
    prompt = _prompt(llm, "Describe a person with pets as JSON.")
    params = [SamplingParams(max_tokens=80, temperature=0.0, structured=JSON_SO)]
    params += [SamplingParams(max_tokens=80, temperature=1.0, seed=s, structured=JSON_SO) for s in range(3)]
    outs = llm.generate([prompt] * len(params), params)
    for out in outs:
        assert out.finish_reason == "stop", _text(llm, out.token_ids)  # complete: nothing more may follow
        jsonschema.validate(json.loads(_text(llm, out.token_ids)), SCHEMA)
    assert llm.engine.grammars.stats.compiles >= 1


@pytest.mark.parametrize(("so", "accept"), [
    (StructuredOutput("regex", r"[0-9]{3}-[a-z]{2}"), lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2}", t)),
    (StructuredOutput("choice", '["alpha", "beta gamma"]'), lambda t: t in ("alpha", "beta gamma")),
    (StructuredOutput("lark", 'start: "x" NUM\nNUM: /[1-9]/'), lambda t: re.fullmatch("x[1-9]", t)),
])
def test_other_kinds_follow_their_grammar(llm: LLM, so: StructuredOutput, accept: object) -> None:
    prompt = _prompt(llm, "Answer.")
    outs = llm.generate([prompt] * 2, [SamplingParams(max_tokens=20, temperature=1.0, seed=s, structured=so)
                                       for s in range(2)])
    for out in outs:
        text = _text(llm, out.token_ids)
        assert out.finish_reason == "stop" and accept(text), text  # type: ignore[operator]


def test_json_object_parses(llm: LLM) -> None:
    prompt = _prompt(llm, "Give a JSON object with one key.")
    out = llm.generate(prompt, SamplingParams(max_tokens=40, temperature=0.0,
                                              structured=StructuredOutput("json_object")))[0]
    assert out.finish_reason == "stop" and isinstance(json.loads(_text(llm, out.token_ids)), dict)


def test_unconstrained_output_differs(llm: LLM) -> None:
    """The mask is what makes the output JSON: the same greedy request without it is not JSON."""
    prompt = _prompt(llm, "Describe a person with pets as JSON.")
    free, constrained = llm.generate([prompt] * 2, [
        SamplingParams(max_tokens=20, temperature=0.0),
        SamplingParams(max_tokens=20, temperature=0.0, structured=JSON_SO)])
    assert free.token_ids[:20] != constrained.token_ids[:20]
    assert _text(llm, constrained.token_ids).startswith('{"name": "')


def test_resumed_continuation_matches_the_uninterrupted_run(llm: LLM) -> None:
    """A migrated request continues from prompt + streamed tokens; its guide replays those tokens."""
    prompt = _prompt(llm, "Describe a person with pets as JSON.")
    whole = llm.generate(prompt, SamplingParams(max_tokens=80, temperature=0.0, structured=JSON_SO))[0]
    for k in (1, 7):
        so = StructuredOutput(JSON_SO.kind, JSON_SO.spec, resumed_tokens=k)
        rest = llm.generate(prompt + whole.token_ids[:k],
                            SamplingParams(max_tokens=80 - k, temperature=0.0, structured=so))[0]
        assert whole.token_ids[:k] + rest.token_ids == whole.token_ids


def test_resumed_tokens_off_the_grammar_are_refused(llm: LLM) -> None:
    so = StructuredOutput(JSON_SO.kind, JSON_SO.spec, resumed_tokens=2)
    with pytest.raises(GrammarError, match="does not follow the grammar"):
        llm.engine.make_request(_prompt(llm, "Hi") + llm.tokenizer.encode("hello"),
                                SamplingParams(structured=so))


def test_decode_side_rebuilds_the_guide_from_the_first_token(llm: LLM) -> None:
    """``reserve`` + ``start_prefilled`` (the decode worker's path): the guide has accepted the prefill
    worker's first token, and allows exactly what a guide replaying that token allows."""
    engine = llm.engine
    prompt = _prompt(llm, "Describe a person with pets as JSON.")
    first = llm.generate(prompt, SamplingParams(max_tokens=1, temperature=0.0, structured=JSON_SO))[0]
    request = engine.make_request(prompt, SamplingParams(max_tokens=5, structured=JSON_SO),
                                  request_id="decode-side")
    assert engine.reserve(request) is not None
    engine.start_prefilled("decode-side", first.token_ids[0])
    assert request.guide is not None and request.guide.num_accepted == 1
    replayed = engine.grammars.guide(JSON_SO, first.token_ids)
    vocab = engine.model_config.vocab_size
    logits = torch.zeros(2, vocab)
    masked = engine.grammars.apply(logits, [request.guide, replayed])
    assert torch.equal(masked[0].isinf(), masked[1].isinf())
    assert 0 < int((~masked[0].isinf()).sum()) < vocab
    engine.abort_request("decode-side")


def test_preemption_keeps_the_guide(tiny_model_dir: Path) -> None:
    """On the tiny model (word-level tokens ``w1``..``w255``) the grammar makes tokens alternate
    ``w1 w2 w1 ...`` (and cannot end before 40 tokens), which the random model would not do: with too
    few KV blocks the requests are preempted and recomputed, and their outputs still alternate (a guide
    reset by the preemption would start over at ``w1``) and equal the roomy run's."""
    alternate = StructuredOutput("regex", "(w1w2){20}")  # cannot end within max_tokens
    prompts = [[(7 * i + j) % 250 + 1 for j in range(20 + 3 * i)] for i in range(4)]
    params = [SamplingParams(max_tokens=24, temperature=1.0, seed=i, ignore_eos=True, structured=alternate)
              for i in range(4)]

    def run(blocks: int) -> tuple[list[list[int]], LLM]:
        llm = LLM(str(tiny_model_dir), block_size=4, max_num_batched_tokens=64, num_kv_blocks=blocks,
                  check_integrity=True)
        return [o.token_ids for o in llm.generate(prompts, params)], llm

    roomy, _ = run(200)
    tight, llm = run(24)
    assert llm.engine.stats().num_preemptions > 0
    assert tight == roomy
    assert all(ids == [1, 2] * 12 for ids in tight)


def test_rollback_restores_the_state(llm: LLM) -> None:
    engine = llm.engine
    ids = llm.tokenizer.encode('{"name": "Al", "age": 3')
    guide = engine.grammars.guide(JSON_SO, ids)
    before = engine.grammars.apply(torch.zeros(1, engine.model_config.vocab_size), [guide]).isinf()
    extra = llm.tokenizer.encode(', "pets": [')
    for t in extra:
        assert guide.accept(t)
    guide.rollback(len(extra))
    after = engine.grammars.apply(torch.zeros(1, engine.model_config.vocab_size), [guide]).isinf()
    assert guide.num_accepted == len(ids) and torch.equal(before, after)
    assert not guide.allows(llm.tokenizer.encode("]")[0])
    with pytest.raises(ValueError, match="cannot roll back"):
        guide.rollback(MAX_ROLLBACK + 1)


def test_compile_is_cached_and_prepared_off_the_caller(llm: LLM) -> None:
    grammars = llm.engine.grammars
    so = StructuredOutput("regex", "[a-c]{5}")
    compiles, hits = grammars.stats.compiles, grammars.stats.cache_hits
    future = grammars.prepare(so)
    matcher = future.result(timeout=30)
    assert grammars.stats.compiles == compiles + 1 and grammars.cached(so)
    again = grammars.prepare(so)
    assert again.done() and again.result() is matcher
    assert grammars.stats.cache_hits == hits + 1


def test_logit_bias_forces_and_bans_tokens(llm: LLM) -> None:
    prompt = _prompt(llm, "Say something.")
    forced = llm.tokenizer.encode(" banana")[0]
    bias = ((forced, 100.0),)
    out = llm.generate(prompt, SamplingParams(max_tokens=3, temperature=0.0, logit_bias=bias))[0]
    assert out.token_ids == [forced] * 3
    free = llm.generate(prompt, SamplingParams(max_tokens=1, temperature=0.0))[0]
    banned = llm.generate(prompt, SamplingParams(max_tokens=1, temperature=0.0,
                                                 logit_bias=((free.token_ids[0], -100.0),)))[0]
    assert banned.token_ids[0] != free.token_ids[0]


# a Pydantic-style schema: no ``additionalProperties``, ``is_capital`` optional
CITY = {"type": "object", "title": "City", "properties": {
    "name": {"type": "string", "maxLength": 40}, "country": {"type": "string", "maxLength": 40},
    "is_capital": {"type": "boolean", "default": False}}, "required": ["name", "country"]}
UNDECLARED = '{"name": "Rome", "country": "Italy", "population": 3}'
WITHOUT_OPTIONAL = '{"name": "Rome", "country": "Italy"}'


def _accepted_until_masked(llm: LLM, so: StructuredOutput, text: str) -> str | None:
    """Feeds ``text``'s tokens to a fresh guide; the text before the first token the step's logit mask
    sets to -inf (None when every token passes). The mask and the guide agree on every token."""
    grammars, vocab = llm.engine.grammars, llm.engine.model_config.vocab_size
    guide = grammars.guide(so)
    ids = llm.tokenizer.encode(text)
    for i, token in enumerate(ids):
        masked = bool(grammars.apply(torch.zeros(1, vocab), [guide])[0, token].isinf())
        assert masked is not guide.allows(token)
        if masked:
            return _text(llm, ids[:i])
        assert guide.accept(token)
    return None


def test_undeclared_key_masked_strict_and_by_default_allowed_when_the_schema_says_so(llm: LLM) -> None:
    strict = StructuredOutput("json_schema", json.dumps(close_objects(CITY, strict=True)))
    default = StructuredOutput("json_schema", json.dumps(CITY))  # the engine closes its objects itself
    open_ = StructuredOutput("json_schema", json.dumps({**CITY, "additionalProperties": True}))
    typed = StructuredOutput("json_schema", json.dumps({**CITY, "additionalProperties": {"type": "string"}}))
    before_key = '{"name": "Rome", "country": "Italy", "'
    # strict: the undeclared key is masked at its first token, and every declared key is required
    assert _accepted_until_masked(llm, strict, UNDECLARED) == before_key
    assert _accepted_until_masked(llm, strict, WITHOUT_OPTIONAL) == '{"name": "Rome", "country": "Italy'
    # not strict, the schema silent about other keys: masked too (vLLM's default); 'required' as written
    assert _accepted_until_masked(llm, default, UNDECLARED) == before_key
    assert _accepted_until_masked(llm, default, WITHOUT_OPTIONAL) is None
    # not strict, the schema admits other keys: allowed, as it says
    assert _accepted_until_masked(llm, open_, UNDECLARED) is None
    assert _accepted_until_masked(llm, typed, UNDECLARED) == UNDECLARED[:-2]  # 3 is no string
    assert _accepted_until_masked(llm, typed, UNDECLARED.replace("3", '"3"')) is None
    with pytest.raises(SchemaError, match="'additionalProperties' admits undeclared properties"):
        close_objects({**CITY, "additionalProperties": True}, strict=True)


def test_strict_closes_objects_at_every_depth(llm: LLM) -> None:
    """A nested object reached through ``$defs`` / ``$ref`` inside an array is closed like the root."""
    schema = {"$defs": {"City": CITY}, "type": "object", "title": "Trip",
              "properties": {"stops": {"type": "array", "items": {"$ref": "#/$defs/City"}, "maxItems": 2}},
              "required": ["stops"]}
    strict = StructuredOutput("json_schema", json.dumps(close_objects(schema, strict=True)))
    nested = '{"stops": [' + UNDECLARED + "]}"
    assert _accepted_until_masked(llm, strict, nested) == '{"stops": [{"name": "Rome", "country": "Italy", "'
    assert _accepted_until_masked(llm, StructuredOutput("json_schema", json.dumps(schema)), nested) \
        == '{"stops": [{"name": "Rome", "country": "Italy", "'
    whole = '{"stops": [{"name": "Rome", "country": "Italy", "is_capital": true}]}'
    assert _accepted_until_masked(llm, strict, whole) is None

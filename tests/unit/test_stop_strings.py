"""Stop strings: never emitted even in part, caught across token boundaries, earliest match wins."""

from __future__ import annotations

import pytest

from engine.tokenizer import Tokenizer
from messages.wire import TokenBatch
from router.admission import AdmissionGate
from router.errors import APIError
from router.streaming import ChoiceDecoder, StopFilter


def run(stops: list[str], pieces: list[str]) -> tuple[list[str], bool]:
    f = StopFilter(stops)
    out = [f.push(p) for p in pieces]
    out.append(f.flush())
    return out, f.stopped


def test_no_stop_passes_everything_through() -> None:
    out, stopped = run([], ["Hello", " world"])
    assert out == ["Hello", " world", ""] and not stopped


def test_stop_inside_one_piece() -> None:
    out, stopped = run(["END"], ["abcENDxyz", "more"])
    assert "".join(out) == "abc" and stopped


@pytest.mark.parametrize("split", [["ab", "cE", "N", "Dxyz"], ["abcE", "ND"], list("abcENDxyz")])
def test_stop_split_across_pieces_is_never_emitted(split: list[str]) -> None:
    f = StopFilter(["END"])
    emitted = ""
    for piece in split:
        emitted += f.push(piece)
        assert "E" not in emitted
    assert emitted == "abc" and f.stopped


def test_false_start_is_released() -> None:
    f = StopFilter(["END"])
    assert f.push("abcE") == "abc"
    assert f.push("N") == ""
    assert f.push("x") == "ENx"
    assert f.push("EN") == ""
    assert f.flush() == "EN"  # generation ended: the held prefix is plain text


def test_earliest_of_several_stops_wins() -> None:
    out, _ = run(["world", "lo w"], ["Hello world"])
    assert "".join(out) == "Hel"


def test_nothing_after_stop() -> None:
    f = StopFilter(["."])
    assert f.push("One. Two.") == "One"
    assert f.push("Three") == ""
    assert f.flush() == ""


@pytest.fixture(scope="module")
def tokenizer(default_tokenizer: Tokenizer) -> Tokenizer:
    return default_tokenizer


def test_decoder_stops_at_the_completing_token(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("The capital of France is Paris. It is big.")
    text = tokenizer.decode(ids)
    dec = ChoiceDecoder(0, tokenizer, ["Paris"])
    pieces = [dec.feed(TokenBatch(request_id="r", token_ids=[t], finished=False)) for t in ids]
    assert "".join(p.text for p in pieces) == text[:text.index("Paris")]
    assert dec.finish_reason == "stop"
    assert dec.num_tokens == next(i for i in range(len(ids)) if "Paris" in tokenizer.decode(ids[:i + 1])) + 1


def test_decoder_flushes_at_finish(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("Hello there, friend")
    dec = ChoiceDecoder(0, tokenizer, ["friendly"])
    delta = dec.feed(TokenBatch(request_id="r", token_ids=ids, finished=True, finish_reason="length"))
    assert delta.text == tokenizer.decode(ids) and delta.finish_reason == "length"


def test_admission_releases_exactly_once() -> None:
    gate = AdmissionGate(max_queued_requests=2, max_queued_tokens=100)
    a = gate.admit(60)
    with pytest.raises(APIError) as info:
        gate.admit(50)
    assert info.value.status == 503 and "Retry-After" in info.value.headers
    b = gate.admit(40)
    with pytest.raises(APIError):
        gate.admit(1)
    a.started()
    assert (gate.queued_requests, gate.queued_tokens, gate.in_flight) == (1, 40, 2)
    a.release()
    a.release()
    b.release()
    assert (gate.queued_requests, gate.queued_tokens, gate.in_flight) == (0, 0, 0)
    with gate.admit(500):  # alone, an oversized request is still admitted
        assert gate.queued_tokens == 500
    assert (gate.queued_requests, gate.queued_tokens, gate.in_flight) == (0, 0, 0)



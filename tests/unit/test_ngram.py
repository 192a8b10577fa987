"""N-gram (prompt lookup) proposals and the speculative_config argument."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.ngram import propose_ngram
from engine.spec_config import SpeculativeConfig, parse_speculative_config


def test_copies_what_followed_the_latest_match_of_the_longest_suffix() -> None:
    tokens = [1, 2, 3, 4, 5, 9, 2, 3, 7, 8, 1, 2, 3]
    # suffix [1, 2, 3] (n=3) matches at the start only: 4, 5, 9 follow it
    assert propose_ngram(tokens, 3, 1, 3) == [4, 5, 9]
    # with n <= 2 the latest match of [2, 3] is at index 6: 7, 8 follow
    assert propose_ngram(tokens, 2, 1, 2) == [7, 8]
    # fewer tokens than k follow the match: as many as there are
    assert propose_ngram([5, 6, 5], 4, 1, 2) == [6, 5]


def test_no_match_or_too_short_proposes_nothing() -> None:
    assert propose_ngram([1, 2, 3, 4], 3, 1, 3) == []
    assert propose_ngram([7], 3, 1, 3) == []
    assert propose_ngram([1, 2, 9, 2], 3, 2, 3) == []  # [9, 2] never occurred before
    assert propose_ngram([1, 2, 1, 2], 0, 1, 2) == []


def test_config_checks_and_flag_forms() -> None:
    spec = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 3, "prompt_lookup_min": 2}
    assert parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 5, '
                                    '"prompt_lookup_max": 3, "prompt_lookup_min": 2}') == spec
    assert parse_speculative_config("method=ngram,num_speculative_tokens=5,prompt_lookup_max=3,"
                                    "prompt_lookup_min=2") == spec
    assert EngineConfig(speculative_config=spec).speculative == SpeculativeConfig(**spec)  # type: ignore[arg-type]
    assert EngineConfig().speculative is None
    for bad in ('{"method": "medusa"}', '{"num_speculative_tokens": 0}', '{"prompt_lookup_min": 5}',
                '{"colour": 1}', "[1]", '{"method": "draft_model"}', '{"model": "/m"}'):
        with pytest.raises(ValueError):
            parse_speculative_config(bad)
    with pytest.raises(ValueError, match="unknown"):
        EngineConfig(speculative_config={"k": 3})

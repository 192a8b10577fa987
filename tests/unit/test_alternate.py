"""bench.alternate: set-up parsing and the report's per-round ratios and medians."""

from __future__ import annotations

import argparse

import pytest

from bench.alternate import parse_system, render, split_env


def test_a_set_up_is_a_name_its_environment_and_its_flags() -> None:
    name, words = parse_system("mkl=PDSERVE_LARGE_PRODUCT=mkl --num-prefill 0 --served-model-name a=b")
    assert name == "mkl"
    assert split_env(words) == (["PDSERVE_LARGE_PRODUCT=mkl"], ["--num-prefill", "0", "--served-model-name",
                                                                  "a=b"])
    assert parse_system("disagg=") == ("disagg", ())
    with pytest.raises(argparse.ArgumentTypeError, match="NAME='FLAGS'"):
        parse_system("no-equals-sign")


def _row(system: str, conc: int, r: int, tok: float) -> dict[str, object]:
    return {"round": r, "system": system, "concurrency": conc, "loadavg": 1.0, "output_tok_s": tok, "ok": 9,
            "sent": 9, "itl_p50_ms": 40.0, "ttft_p50_ms": 900.0}


def test_ratios_are_taken_within_a_round_and_summarised_by_medians() -> None:
    rows = [_row("a", 16, 0, 100.0), _row("b", 16, 0, 90.0), _row("b", 16, 1, 120.0), _row("a", 16, 1, 150.0),
            _row("a", 16, 2, 110.0), _row("b", 16, 2, 121.0), _row("a", 4, 0, 50.0), _row("b", 4, 0, 60.0)]
    text = render(rows, ["a", "b"], "header")
    assert text.startswith("header\n")
    assert "| 16 | 1 | b | 1.00 | 9/9 | 120.0 | 0.800 | 40 | 900 |" in text
    assert "| 4 | 0 | b | 1.00 | 9/9 | 60.0 | 1.200 | 40 | 900 |" in text
    # round ratios 0.9, 0.8, 1.1: the median ratio is 0.9, not the ratio of the medians (120 / 110)
    assert "- concurrency 16, b: median 120.0 tok/s (min 90.0, max 121.0); median ratio to a 0.900" in text
    assert "- concurrency 16, a: median 110.0 tok/s (min 100.0, max 150.0); median ratio to a 1.000" in text
    assert "- concurrency 4, b: median 60.0 tok/s (min 60.0, max 60.0); median ratio to a 1.200" in text

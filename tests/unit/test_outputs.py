"""RequestOutput.text: decoded on first read by the reader, never while the engine steps."""

from __future__ import annotations

from engine.outputs import RequestMetrics, RequestOutput


def test_text_is_decoded_once_on_first_read_and_only_when_finished() -> None:
    calls: list[list[int]] = []

    def detokenize(ids: list[int]) -> str:
        calls.append(list(ids))
        return "-".join(map(str, ids))

    running = RequestOutput("a", None, [1], [5, 6], False, None, RequestMetrics(0.0), detokenize=detokenize)
    assert running.text == "" and calls == []
    done = RequestOutput("a", None, [1], [5, 6], True, "length", RequestMetrics(0.0), detokenize=detokenize)
    assert calls == []  # building the output (the engine's step) decodes nothing
    assert done.text == "5-6" and done.text == "5-6"
    assert calls == [[5, 6]]

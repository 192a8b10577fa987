"""The compiled decode path (engine/compiled.py) against the eager one on a tiny model."""

from __future__ import annotations

import torch

from engine.compiled import CompiledDecoder
from tests.unit.test_model_tiny import PagedRunner, hf_model, prompt


def greedy(runner: PagedRunner, prompts: list[list[int]], steps: int) -> tuple[list[list[int]], torch.Tensor]:
    """Greedy tokens per sequence after an eager prefill, and the last decode step's logits."""
    logits = runner.step(list(enumerate(prompts)))
    tokens = [[int(rows[-1].argmax())] for rows in logits]
    for _ in range(steps):
        logits = runner.step([(i, t[-1:]) for i, t in enumerate(tokens)])
        for t, rows in zip(tokens, logits, strict=True):
            t.append(int(rows[-1].argmax()))
    return tokens, torch.cat(logits)


def test_compiled_decode_matches_eager_tokens() -> None:
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    hf = hf_model("llama3")
    prompts = [prompt(9, seed=5), prompt(17, seed=6), prompt(4, seed=7)]  # 3 rows: padded to bucket 4
    eager = PagedRunner(hf)
    compiled = PagedRunner(hf)
    compiled.compiled = CompiledDecoder(compiled.model, max_num_seqs=8)
    expected, expected_logits = greedy(eager, prompts, 6)
    got, got_logits = greedy(compiled, prompts, 6)
    assert got == expected
    torch.testing.assert_close(got_logits, expected_logits, atol=1e-4, rtol=1e-4)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 2  # both layer halves ran compiled

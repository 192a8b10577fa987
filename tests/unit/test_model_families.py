"""Every registered family against transformers, fp32: our paged ``CausalLM``, loaded from the folder
transformers saved, gives transformers' logits for chunked prompts, mixed batches and decode steps."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import PreTrainedModel

from engine.loader import load_model_source
from engine.models.causal_lm import CausalLM
from tests.families import BUILDERS, MIN_MARGIN, clear_margin, hf_greedy, prompt, save
from tests.unit.test_model_tiny import BLOCK_SIZE, PagedRunner

FAMILIES = [f for f in BUILDERS if f != "llama"]


@pytest.fixture(scope="module", params=FAMILIES)
def saved(request: pytest.FixtureRequest,
          tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path, PreTrainedModel]:
    folder = tmp_path_factory.mktemp(request.param)
    return request.param, folder, save(request.param, folder)


def _runner(folder: Path) -> PagedRunner:
    source = load_model_source(folder)
    model = CausalLM(source.config, torch.float32)
    model.load_weights(source.iter_weights())
    return PagedRunner.over(model)


def test_chunked_prompt_and_decode_match_transformers(saved: tuple[str, Path, PreTrainedModel]) -> None:
    family, folder, hf = saved
    runner = _runner(folder)
    tokens = prompt(27, seed=2)  # longer than the sliding windows, prefilled in chunks across them
    logits = torch.cat([runner.step([(0, tokens[i : i + 10])])[0] for i in range(0, 27, 10)])
    with torch.inference_mode():
        expected = hf(torch.tensor([tokens])).logits[0]
    torch.testing.assert_close(logits, expected, atol=2e-4, rtol=2e-4)
    generated = [int(logits[-1].argmax())]
    for _ in range(9):
        generated.append(int(runner.step([(0, generated[-1:])])[0][-1].argmax()))
    reference = hf_greedy(hf, tokens, 10)
    assert clear_margin(hf, tokens, reference) > MIN_MARGIN
    assert generated == reference, family


def test_mixed_batch_matches_transformers_per_sequence(saved: tuple[str, Path, PreTrainedModel]) -> None:
    _, folder, hf = saved
    runner = _runner(folder)
    a, b = prompt(19, seed=3), prompt(6 * BLOCK_SIZE + 1, seed=4)
    runner.step([(0, a[:9]), (1, b[:5])])
    logits_a, logits_b = runner.step([(0, a[9:]), (1, b[5:])])
    out_a, out_b = [int(logits_a[-1].argmax())], [int(logits_b[-1].argmax())]
    for _ in range(7):
        logits_b, logits_a = runner.step([(1, out_b[-1:]), (0, out_a[-1:])])
        out_a.append(int(logits_a[-1].argmax()))
        out_b.append(int(logits_b[-1].argmax()))
    assert out_a == hf_greedy(hf, a, 8)
    assert out_b == hf_greedy(hf, b, 8)

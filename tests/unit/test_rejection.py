"""Speculative verification keeps the sampling distribution: chi-square tests at temperature 1, on
fixed logits (``engine.rejection.verify``) and end to end on a small-vocabulary model with n-gram
proposals and with a draft model's."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Hashable
from pathlib import Path
from typing import TypeVar

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from engine import LLM, SamplingParams
from engine.rejection import verify
from engine.sampling import Sampler, SamplingState
from tests.unit.conftest import perturb_weights, save_word_tokenizer

Z_999 = 3.090  # standard normal quantile 0.999: each test fails by chance once in a thousand seedings


def chi2_critical(df: int) -> float:
    """The 0.999 quantile of chi-square with ``df`` degrees of freedom (Wilson-Hilferty)."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + Z_999 * math.sqrt(a)) ** 3


K = TypeVar("K", bound=Hashable)


def chi2(counts: Counter[K], expected: dict[K, float]) -> tuple[float, int]:
    """Pearson's statistic over ``expected``'s cells (each >= 5; the rest pooled) and its df."""
    n = sum(counts.values())
    big = {c: e for c, e in expected.items() if e >= 5.0}
    rest_e = n - sum(big.values())
    rest_o = n - sum(counts[c] for c in big)
    stat = sum((counts[c] - e) ** 2 / e for c, e in big.items())
    cells = len(big)
    if rest_e >= 5.0:
        stat += (rest_o - rest_e) ** 2 / rest_e
        cells += 1
    else:
        assert rest_o <= 3 * max(rest_e, 1.0), "too many samples outside the expected cells"
    return stat, cells - 1


def test_verify_samples_from_the_target_at_every_position() -> None:
    vocab, n = 8, 6000
    torch.manual_seed(0)
    rows = torch.randn(3, vocab) * 1.5
    draft = [int(rows[0].argsort()[-2]), int(rows[1].argmax())]  # a likely, not the likeliest, token first
    p = rows.softmax(-1)
    logits = rows.repeat(n, 1)
    states = [SamplingState(SamplingParams(temperature=1.0, seed=s), [1, 2]) for s in range(n)]
    out = verify(Sampler(), logits, states, [draft] * n)
    first = Counter(t[0] for t in out.token_ids)
    stat, df = chi2(first, {t: n * float(p[0, t]) for t in range(vocab)})
    assert stat < chi2_critical(df)
    accepted = [t for t in out.token_ids if t[0] == draft[0]]
    assert all(len(t) >= 2 for t in accepted) and all(len(t) == 1 for t in out.token_ids if t[0] != draft[0])
    second = Counter(t[1] for t in accepted)
    stat, df = chi2(second, {t: len(accepted) * float(p[1, t]) for t in range(vocab)})
    assert stat < chi2_critical(df)
    both = [t for t in accepted if t[1] == draft[1]]
    assert all(len(t) == 3 for t in both)
    third = Counter(t[2] for t in both)
    stat, df = chi2(third, {t: len(both) * float(p[2, t]) for t in range(vocab)})
    assert stat < chi2_critical(df)


SMALL_VOCAB = 16
DRAFT_PERTURB = 0.1


def save_small_vocab_model(folder: Path, seed: int, perturb: float = 0.0) -> Path:
    """A seeded random 2-layer Llama over 16 tokens with large weights: its next-token distributions are
    peaked enough for a chi-square over pairs of tokens with a thousand samples. ``perturb``: seeded
    noise of that size added to every weight."""
    save_word_tokenizer(folder, SMALL_VOCAB)
    config = LlamaConfig(vocab_size=SMALL_VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                         bos_token_id=None, eos_token_id=None, pad_token_id=None, initializer_range=0.3)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    perturb_weights(model, seed + 1, perturb)
    model.save_pretrained(str(folder), safe_serialization=True)
    return folder


@pytest.fixture(scope="module")
def small_vocab_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_small_vocab_model(tmp_path_factory.mktemp("small-vocab-llama"), seed=1)


def joint_first_two(model_dir: Path, prompt: list[int], n: int) -> dict[tuple[int, int], float]:
    """Expected counts of (first, second) tokens over ``n`` samples at temperature 1."""
    model = LlamaForCausalLM.from_pretrained(str(model_dir)).eval()
    with torch.no_grad():
        p0 = model(torch.tensor([prompt])).logits[0, -1].softmax(-1)
        p1 = model(torch.tensor([[*prompt, t] for t in range(SMALL_VOCAB)])).logits[:, -1].softmax(-1)
    return {(x, y): n * float(p0[x] * p1[x, y]) for x in range(SMALL_VOCAB) for y in range(SMALL_VOCAB)}


def test_engine_with_ngram_samples_from_the_model(small_vocab_model: Path) -> None:
    """Over many seeds, (first, second) output tokens follow the model's joint distribution at
    temperature 1; the second is verified against a one-token n-gram proposal, accepted often enough
    that both branches (accepted, resampled) carry weight."""
    n = 1000
    model = LlamaForCausalLM.from_pretrained(str(small_vocab_model)).eval()
    # every token once, then three rounds of "x y" pairs, y the model's likeliest token after x (as seen
    # from the prompt so far): each first token x finds a proposal, often a likely one
    prompt = [int(t) + 1 for t in torch.randperm(SMALL_VOCAB - 1, generator=torch.Generator().manual_seed(4))]
    with torch.no_grad():
        for _ in range(3):
            p1 = model(torch.tensor([[*prompt, t] for t in range(SMALL_VOCAB)])).logits[:, -1].softmax(-1)
            for x in sorted(range(SMALL_VOCAB), key=lambda t: float(p1[t].max())):
                prompt += [x, int(p1[x].argmax())]
    llm = LLM(str(small_vocab_model), block_size=16, num_kv_blocks=2000, max_num_seqs=256,
              speculative_config={"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1,
                                  "prompt_lookup_max": 2, "min_acceptance": 0.0})
    params = [SamplingParams(max_tokens=3, temperature=1.0, seed=s, ignore_eos=True) for s in range(n)]
    outs = llm.generate([prompt] * n, params)
    pairs = Counter((o.token_ids[0], o.token_ids[1]) for o in outs)
    spec = llm.engine.stats().spec
    assert spec is not None and spec.num_drafts > 0.9 * n and spec.num_accepted_tokens > 0.05 * n

    stat, df = chi2(pairs, joint_first_two(small_vocab_model, prompt, n))
    assert df > 10 and stat < chi2_critical(df)


def test_engine_with_a_draft_model_samples_from_the_target(small_vocab_model: Path,
                                                           tmp_path: Path) -> None:
    """The same joint test with the target's weights perturbed as the greedy draft: its proposals for
    the second token are sometimes right, sometimes wrong, and the target's distribution holds."""
    n = 1000
    draft = save_small_vocab_model(tmp_path / "draft", seed=1, perturb=DRAFT_PERTURB)
    prompt = [int(t) + 1 for t in torch.randperm(SMALL_VOCAB - 1, generator=torch.Generator().manual_seed(5))]
    llm = LLM(str(small_vocab_model), block_size=16, num_kv_blocks=2000, max_num_seqs=256,
              speculative_config={"method": "draft_model", "model": str(draft), "num_speculative_tokens": 2,
                                  "min_acceptance": 0.0})
    params = [SamplingParams(max_tokens=3, temperature=1.0, seed=s, ignore_eos=True) for s in range(n)]
    outs = llm.generate([prompt] * n, params)
    pairs = Counter((o.token_ids[0], o.token_ids[1]) for o in outs)
    spec = llm.engine.stats().spec
    assert spec is not None and spec.num_drafts > 0.9 * n
    assert 0.05 * spec.num_draft_tokens < spec.num_accepted_tokens < 0.95 * spec.num_draft_tokens
    stat, df = chi2(pairs, joint_first_two(small_vocab_model, prompt, n))
    assert df > 10 and stat < chi2_critical(df)

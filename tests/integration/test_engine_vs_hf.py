"""Greedy output of the engine equals Hugging Face transformers, token for token (float32, CPU)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from engine import LLM, SamplingParams
from engine.loader import default_model_path

NEW_TOKENS = 32  # each chat prompt (37-41 tokens) still ends 5 blocks long: 7 prompts need 29 > 14 blocks

STORY = (
    "The lighthouse keeper counted the ships that passed each night and wrote their names in a "
    "leather book. {i}: one evening a vessel with red sails appeared, carrying no lights at all, "
    "and the keeper noted the hour, the wind from the north-east and the state of the tide. "
)


def long_document() -> str:
    return "".join(STORY.format(i=i) for i in range(24)) + "\nSummarize the keeper's notes:"


CHATS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in two sentences.",
    "List three prime numbers greater than 100.",
]
RAW = [
    "def fibonacci(n):\n    ",
    "The three primary colors are",
    "Once upon a time, in a small village by the mountains,",
]


@pytest.fixture(scope="module")
def gguf() -> Path:
    path = default_model_path()
    assert path.exists(), f"default model missing at {path}: run scripts/setup.sh"
    return path


@pytest.fixture(scope="module")
def llm(gguf: Path) -> LLM:
    return LLM(model=str(gguf), dtype="float32", max_num_batched_tokens=64, max_num_seqs=16,
               check_integrity=True)


@pytest.fixture(scope="module")
def prompts(llm: LLM) -> list[list[int]]:
    tok = llm.tokenizer
    out = [tok.apply_chat_template([{"role": "user", "content": c}]) for c in CHATS]
    out += [tok.encode(r) for r in RAW]
    out.append(tok.encode(long_document()))
    assert len(out[-1]) > 1000
    return out


@pytest.fixture(scope="module")
def hf_reference(transformers_default_model: Any, prompts: list[list[int]]) -> list[list[int]]:
    model = transformers_default_model
    refs = []
    with torch.inference_mode():
        for ids in prompts:
            x = torch.tensor([ids])
            y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=NEW_TOKENS,
                               do_sample=False, pad_token_id=0)
            refs.append(y[0, len(ids):].tolist())
    return refs


def greedy(n: int = NEW_TOKENS) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0)


def test_greedy_matches_transformers_in_one_mixed_chunked_batch(
    llm: LLM, prompts: list[list[int]], hf_reference: list[list[int]]
) -> None:
    head = llm.engine.runner.model.greedy_head
    assert head is not None, "the default model's LM head takes the greedy head on CPU float32"
    steps = head.steps
    outs = llm.generate(prompts, greedy())
    assert head.steps > steps  # every row greedy: the tokens below came through kernels/greedy_head.py
    for i, (out, ref) in enumerate(zip(outs, hf_reference, strict=True)):
        assert out.token_ids == ref, f"prompt {i} diverged"
        assert out.finish_reason == ("stop" if len(ref) < NEW_TOKENS else "length")
    france = llm.tokenizer.decode(outs[0].token_ids)
    assert "Paris" in france
    assert llm.engine.kv.pool.num_used_blocks == 0
    llm.engine.kv.check_integrity()


def test_prefix_caching_reuses_512_token_prefix(llm: LLM, gguf: Path) -> None:
    tok = llm.tokenizer
    prefix = tok.encode(long_document())[:512]
    first = prefix + tok.encode(" Question one: who kept the book?")
    second = prefix + tok.encode(" Question two: what colour were the sails?")
    [a] = llm.generate([first], greedy(16))
    [b] = llm.generate([second], greedy(16))
    assert a.metrics.cached_prompt_tokens == 0 or a.metrics.cached_prompt_tokens % 16 == 0
    assert b.metrics.cached_prompt_tokens >= 512
    assert b.metrics.prompt_tokens == len(second)
    nocache = LLM(model=str(gguf), dtype="float32", enable_prefix_caching=False, max_num_batched_tokens=256)
    [c] = nocache.generate([second], greedy(16))
    assert c.metrics.cached_prompt_tokens == 0
    assert b.token_ids == c.token_ids


def test_tiny_kv_budget_preempts_and_output_is_unchanged(
    llm: LLM, gguf: Path, prompts: list[list[int]], hf_reference: list[list[int]]
) -> None:
    small = prompts[:7]
    tight = LLM(model=str(gguf), dtype="float32", num_kv_blocks=14, block_size=16,
                max_num_batched_tokens=128, check_integrity=True, enable_prefix_caching=False)
    outs = tight.generate(small, greedy())
    assert tight.engine.scheduler.num_preemptions > 0
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    for i, (out, ref) in enumerate(zip(outs, hf_reference[:7], strict=True)):
        assert out.token_ids == ref, f"prompt {i} diverged after preemption"
    assert tight.engine.kv.pool.num_used_blocks == 0

"""bfloat16 greedy against float32 on the GPU, on a tiny random Llama that transformers builds and saves
(the default model's GGUF, 98 MB, cannot travel to the device machine). Skipped without CUDA, except in
the first-light dry run (``PDSERVE_FIRST_LIGHT_DRY=1``, ``bench/lab/first_light.py``), which runs it on
CPU so that a Python error shows before a device is lent.

The tiny model's weights are scaled so that float32's greedy picks are mostly clear
(``tests/families.py``); bfloat16 rounds every product, so the test asserts each prompt's tokens equal
up to the first float32 pick closer than ``MARGIN`` (a near tie either may flip: the second prompt has
one at its 9th token, 0.035 nats), at least 64 clear picks in all, and records the share of all 144
tokens that are equal."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from tests.families import agree_up_to_a_near_tie, prompt, save

DRY = os.environ.get("PDSERVE_FIRST_LIGHT_DRY") == "1"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# not marked ``gpu`` (which tests/conftest.py skips without CUDA): the dry run runs it on CPU
pytestmark = pytest.mark.skipif(DEVICE != "cuda" and not DRY, reason="needs a CUDA device")
NEW_TOKENS = 48
MARGIN = 0.5  # float32 logprob gap of a clear pick (bfloat16 moves these logprobs by up to ~0.3)


def test_bf16_greedy_equals_float32(tmp_path: Path, record_property: Callable[[str, object], None]) -> None:
    save("llama", tmp_path)
    prompts = [prompt(n, seed=n) for n in (5, 17, 40)]
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=2)
    runs = {}
    for dtype in ("float32", "bfloat16"):
        llm = LLM(model=str(tmp_path), dtype=dtype, device=DEVICE, num_kv_blocks=64, block_size=16)
        runs[dtype] = llm.generate(prompts, params)
        del llm
    pairs = list(zip(runs["float32"], runs["bfloat16"], strict=True))
    same = sum(a == b for f, h in pairs for a, b in zip(f.token_ids, h.token_ids, strict=True))
    record_property("bf16_equal_share", same / (len(prompts) * NEW_TOKENS))
    clear = sum(agree_up_to_a_near_tie(h.token_ids, f.token_ids,
                                       (t.top for t in f.logprobs or [] if t is not None), MARGIN)
                for f, h in pairs)
    assert clear >= 64

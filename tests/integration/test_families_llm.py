"""Every new family through ``LLM`` against transformers, float32: greedy tokens equal token for token
at tensor parallelism 1 and 2, in a run that chunks its prompts, hits the prefix cache and preempts.

The pool holds the longest sequence and a little more, not the batch (``_pool``): the scheduler
preempts and recomputes, which must not change a token. Before that, the longest prompt runs alone
twice, the second time hitting every block the first left cached."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from engine import LLM, SamplingParams
from tests.families import MIN_MARGIN, NEW_FAMILIES, clear_margin, hf_greedy, prompt, save

pytestmark = pytest.mark.slow
NEW_TOKENS = 12
ENGINE: dict[str, Any] = dict(dtype="float32", block_size=4, max_num_batched_tokens=16, num_threads=1,
                              check_integrity=True, tp_timeout_s=30.0)


@pytest.fixture(scope="module", params=NEW_FAMILIES)
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path, Any]:
    folder = tmp_path_factory.mktemp(request.param)
    return request.param, folder, save(request.param, folder)


def _batch() -> list[list[int]]:
    return [prompt(n, seed=n) for n in (9, 27, 38)]


@pytest.mark.parametrize("tp", [1, 2])
def test_greedy_equals_transformers(family: tuple[str, Path, Any], tp: int) -> None:
    name, folder, hf = family
    batch = _batch()
    expected = [hf_greedy(hf, ids, NEW_TOKENS) for ids in batch]
    assert min(clear_margin(hf, ids, out) for ids, out in zip(batch, expected, strict=True)) > MIN_MARGIN
    llm = LLM(model=str(folder), tensor_parallel_size=tp, num_kv_blocks=_pool(folder), **ENGINE)
    if name.startswith("deepseek") and tp == 1:  # decode rows on the native latent kernel (cpu_mla.c)
        assert type(llm.engine.runner.backend).__name__ == "MlaNativeBackend"
    greedy = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)
    first, again = (llm.generate(batch[2:], greedy)[0] for _ in range(2))
    assert first.token_ids == again.token_ids == expected[2], name
    assert again.metrics.cached_prompt_tokens == 36  # every whole block before the prompt's last token
    crowd = llm.generate(batch, greedy)
    assert [o.token_ids for o in crowd] == expected, name
    assert llm.engine.stats().num_preemptions > 0, "the pool was meant to be too small for the whole batch"
    assert llm.engine.kv.pool.num_used_blocks == 0


def _pool(folder: Path) -> int:
    """Blocks for the longest sequence (38 + 12 tokens) in every KV group, two more per group, and four."""
    from engine.kv_groups import blocks_per_sequence, kv_groups
    from engine.loader import load_model_source

    groups = kv_groups(load_model_source(folder).config)
    return blocks_per_sequence(groups, 38 + NEW_TOKENS, ENGINE["block_size"]) + 2 * len(groups) + 4

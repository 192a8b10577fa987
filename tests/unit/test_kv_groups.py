"""KV groups: which layers share a table, exact block ids as a sliding group's window moves on, prefix
hits across groups, and a hybrid model's blocks held per sequence against full attention."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from engine import LLM, SamplingParams
from engine.config import FULL_ATTENTION, SLIDING_ATTENTION, EngineConfig, ModelConfig
from engine.engine import LLMEngine
from engine.hashing import block_hashes, group_hash
from engine.kv_cache import KVCacheManager
from engine.kv_groups import (
    NULL_BLOCK,
    KvGroup,
    blocks_per_sequence,
    kv_groups,
    max_sequence_tokens,
    num_slots,
)
from tests.families import WINDOW, hf_greedy, prompt, save

BS = 4


def _config(kinds: list[str], window: int | None = 1024) -> ModelConfig:
    return ModelConfig(architecture="gemma3", vocab_size=8, hidden_size=8, intermediate_size=8,
                       num_layers=len(kinds), num_heads=2, num_kv_heads=1, head_dim=4, rms_norm_eps=1e-6,
                       rope_theta=1e4, max_position_embeddings=4096, layer_types=tuple(kinds),
                       sliding_window=window)


def test_gemma3_27b_layers_group_by_ten() -> None:
    kinds = [FULL_ATTENTION if (i + 1) % 6 == 0 else SLIDING_ATTENTION for i in range(62)]
    groups = kv_groups(_config(kinds))
    assert num_slots(groups) == 10
    assert groups[0] == KvGroup(tuple(range(5, 62, 6)), None)  # full attention first: the router's group
    sliding = [i for i in range(62) if (i + 1) % 6]
    assert [g.layers for g in groups[1:]] == [tuple(sliding[i : i + 10]) for i in range(0, 52, 10)]
    assert all(g.window == 1024 for g in groups[1:]) and len(groups[-1].layers) == 2
    # 8k tokens in blocks of 16: 512 for the full group, 1024 / 16 + 1 for each of the six sliding ones
    assert blocks_per_sequence(groups, 8192, 16) == 512 + 6 * 65


def test_alternating_and_uniform_models() -> None:
    alternating = kv_groups(_config([SLIDING_ATTENTION, FULL_ATTENTION] * 18, window=128))
    assert [(g.layers, g.window) for g in alternating] == [(tuple(range(1, 36, 2)), None),
                                                           (tuple(range(0, 36, 2)), 128)]
    assert kv_groups(_config([FULL_ATTENTION] * 4)) == (KvGroup((0, 1, 2, 3)),)
    assert kv_groups(_config([SLIDING_ATTENTION] * 4, window=64)) == (KvGroup((0, 1, 2, 3), 64),)
    # only windows: any length fits once the windows do
    assert max_sequence_tokens((KvGroup((0,), 8),), 4, BS) > 10**9
    assert max_sequence_tokens((KvGroup((0,), 8),), 3, BS) == 0


def _hybrid(num_blocks: int = 12) -> KVCacheManager:
    return KVCacheManager(num_blocks, BS, groups=(KvGroup((1,)), KvGroup((0,), 6)))


def test_sliding_group_gives_back_blocks_its_window_left() -> None:
    kv = _hybrid()
    tokens = list(range(100, 114))  # 14 tokens: blocks 0..3
    assert kv.allocate("a", 14)
    assert kv.tables_of("a") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    kv.cache_blocks("a", tokens, 14)
    # the next query sits at position 14 and reads from 14 - 6 + 1 = 9: block 2 on
    assert kv.release_outside_window("a", 14) == 2
    assert kv.tables_of("a") == [[0, 1, 2, 3], [NULL_BLOCK, NULL_BLOCK, 6, 7]]
    assert kv.pool.num_used_blocks == 6
    hashes = block_hashes(tokens, BS, kv.hash_seed)
    assert kv.pool.lookup(group_hash(hashes[0], 1)) == 4  # given back, still cached (evicted last)
    assert kv.pool.free_queue.ids()[-2:] == [4, 5]
    assert [e.block_hash for e in kv.drain_events()] == hashes  # group 0's blocks only are announced
    kv.check_integrity()
    assert kv.free("a") == 6
    kv.check_integrity()


def test_prefix_hit_needs_the_window_at_its_end() -> None:
    kv = _hybrid()
    tokens = list(range(100, 114))
    kv.allocate("a", 14)
    kv.cache_blocks("a", tokens, 14)
    kv.release_outside_window("a", 14)
    # 3 full blocks cached in group 0; at 12 tokens the window reads from position 7: blocks 1 and 2
    hit = kv.find_prefix(tokens, 13)
    assert hit.num_blocks == 3 and hit.tables == [[0, 1, 2], [NULL_BLOCK, 5, 6]]
    assert kv.allocate("b", 14, hit)
    kv.check_integrity()
    kv.free("a")
    kv.free("b")
    assert kv.pool.free_queue.ids() == [10, 11, 4, 3, 7, 8, 2, 1, 0, 9, 6, 5]
    # evicting the sliding group's first block (4) costs nothing: a hit of 3 blocks reads 5 and 6
    assert kv.pool.allocate(4) == [10, 11, 4, 3]
    assert kv.find_prefix(tokens, 13).tables == [[0, 1, 2], [NULL_BLOCK, 5, 6]]
    # evicting group 0's third block (2) caps the hit at 2 blocks, whose window needs block 4: gone,
    # and so is every shorter hit's
    assert kv.pool.allocate(3) == [7, 8, 2]
    hit = kv.find_prefix(tokens, 13)
    assert hit.num_blocks == 0 and hit.tables == [[], []]
    kv.pool.check_integrity()  # the blocks taken here have no owner in the manager


@pytest.fixture(scope="module")
def gemma(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    folder = tmp_path_factory.mktemp("gemma3")
    return folder, save("gemma3", folder)


ENGINE: dict[str, Any] = dict(dtype="float32", block_size=BS, num_threads=1, kv_cache_memory=1024**2,
              max_num_batched_tokens=16)


def test_long_generation_matches_transformers_with_and_without_groups(gemma: tuple[Path, object]) -> None:
    folder, hf = gemma
    ids = prompt(30, seed=8)  # prefilled in two chunks, then 30 tokens, all far past the window of 7
    expected = hf_greedy(hf, ids, 30)  # type: ignore[arg-type]
    for hybrid in (True, False):
        llm = LLM(model=str(folder), hybrid_kv=hybrid, check_integrity=True, **ENGINE)
        [out] = llm.generate([ids], SamplingParams(max_tokens=30, temperature=0.0))
        assert out.token_ids == expected, hybrid
        again = llm.generate([ids], SamplingParams(max_tokens=30, temperature=0.0))[0]
        assert again.token_ids == expected and again.metrics.cached_prompt_tokens == 28  # a prefix hit


def test_blocks_held_per_sequence_against_full_attention(gemma: tuple[Path, object]) -> None:
    folder, _ = gemma
    engine = LLMEngine(str(folder), _engine_config())
    request = engine.add_request(prompt(40, seed=9), SamplingParams(max_tokens=24, temperature=0.0))
    while engine.requests[request.request_id].num_tokens < 60:
        engine.step()
    tables = engine.kv.tables_of(request.request_id)
    held = [sum(b != NULL_BLOCK for b in t) for t in tables]
    # 4 layers, one full: one full group of 15 blocks (59 tokens computed + the next) and three sliding
    # groups of one layer each that hold the 2 or 3 blocks their window of 7 spans
    assert [len(g.layers) for g in engine.kv.groups] == [1, 1, 1, 1]
    assert held[0] == 15 and all(2 <= n <= 3 for n in held[1:])
    assert engine.kv.pool.num_used_blocks == sum(held)
    full = LLMEngine(str(folder), _engine_config(hybrid_kv=False))
    other = full.add_request(prompt(40, seed=9), SamplingParams(max_tokens=24, temperature=0.0))
    while full.requests[other.request_id].num_tokens < 60:
        full.step()
    # one table of 4-layer blocks against four of 1-layer blocks: 15 x 4 layer-blocks against ~23
    assert full.kv.pool.num_used_blocks == 15
    assert full.runner.kv_cache.shape[0] == 4 and engine.runner.kv_cache.shape[0] == 1


def _engine_config(**kw: Any) -> EngineConfig:
    return EngineConfig(**{**ENGINE, **kw})


def test_window_of_the_test_models_is_seven() -> None:
    assert WINDOW == 7

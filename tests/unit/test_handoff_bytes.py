"""Bytes one disaggregated handoff moves, measured on the real workers' pull over NIXL, against the
arithmetic: a hybrid model's sliding layers move the blocks their window reads and no others; a
latent-attention model moves layers x latent values x element size per token."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from bench.lab.handoff_bytes import (
    expected_gemma_bytes,
    expected_mla_bytes,
    gemma3_config,
    handoff,
    mla_config,
    model_dir,
)
from engine.config import EngineConfig

BS = 4
CONFIG = EngineConfig(dtype="float32", block_size=BS, max_num_batched_tokens=64, num_threads=1,
                      kv_cache_memory=16 * 2**20)


@pytest.fixture(scope="module")
def gemma(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return model_dir(gemma3_config(layers=6, hidden=64, window=9, vocab=512), tmp_path_factory.mktemp("g"))


@pytest.mark.parametrize("hybrid", [True, False])
def test_hybrid_handoff_moves_the_windows(gemma: Path, hybrid: bool) -> None:
    moved = handoff(gemma, dataclasses.replace(CONFIG, hybrid_kv=hybrid), 42)
    assert moved.bytes == expected_gemma_bytes(gemma, 42, BS, hybrid, 4)
    # 11 blocks of 42 tokens; at position 42 a window of 9 reads 34..41: blocks 8..10
    if hybrid:
        assert moved.slots == 1 and moved.held_blocks == [11] + [3] * 5
        assert moved.blocks == 11 + 5 * 3
    else:
        assert moved.slots == 6 and moved.held_blocks == [11] and moved.blocks == 11


def test_latent_handoff_moves_one_row_per_token_per_layer(tmp_path: Path) -> None:
    folder = model_dir(mla_config(layers=2, hidden=64, vocab=512), tmp_path)
    moved = handoff(folder, CONFIG, 40)
    assert moved.bytes == expected_mla_bytes(2, 512 + 64, 40, BS, 4) == 2 * 576 * 4 * 40
    assert moved.block_bytes == 2 * BS * 576 * 4

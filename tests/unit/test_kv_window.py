"""Attention sinks + sliding window: a long generation keeps a bounded number of KV blocks."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from engine.config import EngineConfig


def test_long_generation_keeps_kv_bounded(tiny_model_dir: Path) -> None:
    # 16 blocks of 4 tokens = 64 tokens of pool, far less than the 600-token generation
    llm = LLM(str(tiny_model_dir), block_size=4, num_kv_blocks=16, kv_sinks=4, kv_window=24,
              check_integrity=True)
    engine = llm.engine
    request = engine.add_request(list(range(1, 11)), SamplingParams(max_tokens=600, temperature=0.0,
                                                                   ignore_eos=True))
    most = 0
    while engine.has_unfinished():
        engine.step()
        held = len(engine.kv.blocks_of(request.request_id))
        most = max(most, held)
    # 1 sink block + the 24-token window (6 blocks) + the block being filled
    assert most <= 1 + 24 // 4 + 2
    assert len(request.output_token_ids) == 600 and request.kv_dropped_tokens > 500
    assert engine.kv.num_free_blocks == 16
    # the sink block and the window are what attention reads: the same prompt reproduces the run
    again = llm.generate([list(range(1, 11))], SamplingParams(max_tokens=600, temperature=0.0,
                                                               ignore_eos=True))[0]
    assert again.token_ids == request.output_token_ids


def test_window_flags_are_checked() -> None:
    with pytest.raises(ValueError, match="--kv-window"):
        EngineConfig(kv_window=0)
    with pytest.raises(ValueError, match="--kv-sinks"):
        EngineConfig(kv_sinks=4)

"""Decode steps replayed from CUDA graphs (engine/graph_runner.py) against the same engine without them
(skipped without CUDA; not yet run on a GPU, README.md).

A graph replays exactly the padded forward, so against ``pad_decode_steps`` with ``enforce_eager`` (the
same padding, run eagerly) tokens and KV bytes must be equal. Against the unpadded eager engine, float32
tokens must be equal; bfloat16 ones may flip on near ties (cuBLAS may pick other kernels for more rows).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.loader import default_model_path
from tests.unit.conftest import save_tiny_llama
from tests.unit.test_graph_runner import ARRIVALS

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
BACKENDS = ["triton"] + (["flashinfer"] if importlib.util.find_spec("flashinfer") else [])
PROMPTS = ["The three primary colors are", "def fibonacci(n):\n    ", "Once upon a time, in a small village,"]
# different lengths, so the batch shrinks from 3 to 1 and the bucket changes
PARAMS = [SamplingParams(max_tokens=n, temperature=0.0) for n in (6, 14, 24)]


def _tokens(backend: str, dtype: str, **kw: Any) -> list[list[int]]:
    llm = LLM(model=str(default_model_path()), dtype=dtype, device="cuda", attention_backend=backend,
              gpu_memory_utilization=0.3, **kw)
    try:
        return [o.token_ids for o in llm.generate(PROMPTS, PARAMS)]
    finally:
        del llm
        torch.cuda.empty_cache()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_graphs_on_and_off_give_the_same_greedy_tokens(backend: str, dtype: str) -> None:
    graphs = _tokens(backend, dtype)
    padded_eager = _tokens(backend, dtype, enforce_eager=True, pad_decode_steps=True)
    eager = _tokens(backend, dtype, enforce_eager=True)
    assert graphs == padded_eager
    if dtype == "float32":
        assert graphs == eager
    else:
        assert sum(a[:4] == b[:4] for a, b in zip(graphs, eager, strict=True)) >= 2


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_replays_with_a_changing_batch_equal_padded_eager_steps(tmp_path: Path, kv_cache_dtype: str) -> None:
    model = save_tiny_llama(tmp_path)
    engines = []
    for eager in (False, True):
        config = EngineConfig(device="cuda", dtype="bfloat16", attention_backend="triton", block_size=4,
                              num_kv_blocks=40, max_num_seqs=8, max_num_batched_tokens=6,
                              enable_prefix_caching=False, kv_cache_dtype=kv_cache_dtype,
                              enforce_eager=eager, pad_decode_steps=eager)
        engines.append(LLMEngine(str(model), config))
    graphed, padded = engines
    runner = graphed.runner.decode_graphs
    assert runner is not None and runner.mode == "capture"
    n = graphed.runner.num_blocks
    captured: dict[int, torch.cuda.CUDAGraph] = {}
    for step in range(12):
        for prompt, max_tokens in ARRIVALS.get(step, []):
            for engine in engines:
                engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0))
        got, want = graphed.step(), padded.step()
        assert [(o.request_id, o.token_ids) for o in got] == [(o.request_id, o.token_ids) for o in want]
        assert torch.equal(graphed.runner.kv_cache[:, :n].view(torch.uint8),
                           padded.runner.kv_cache[:, :n].view(torch.uint8)), step
        for bucket, entry in runner.buckets.items():
            assert entry.graph is not None
            assert captured.setdefault(bucket, entry.graph) is entry.graph  # captured once, replayed after
    assert set(captured) == {1, 4, 8}

"""The CUDA-graph decode path (engine/graph_runner.py) on CPU, with no capture: an engine with
``pad_decode_steps`` beside the same engine unpadded, step by step, while requests join and finish
(so the bucket changes). Exact: the same tokens, and the block pool's KV bytes (and fp8 scales) equal
after every step, so no pad row ever wrote a real block; the scratch block was written. Exactness of
the KV needs GEMMs whose rows do not depend on the row count: the default prepacked linear kernel
gives that here (``F.linear`` does not: 3 rows and 4 differ by ~3e-6, see engine/cuda_graphs.py).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.config import EngineConfig
from engine.cuda_graphs import DecodeGraphs
from engine.engine import LLMEngine
from engine.graph_runner import DecodeGraphRunner, graph_mode
from engine.sampling import SamplingParams
from engine.tp_group import StepPlan
from kernels import TorchAttentionBackend
from kernels.flashinfer_backend import write_rows
from kernels.triton_backend import TritonAttentionBackend, decode_block_writes, plan_block_writes

Arrivals = dict[int, list[tuple[list[int], int]]]
# joins at steps 0, 2 and 4; the last prompt arrives with five sequences decoding and a token budget of
# 6, so it is fed one token a step: pure-decode-shaped steps with a row that samples nothing
ARRIVALS: Arrivals = {
    0: [([5, 17, 3, 99, 42], 9), ([11, 12, 13], 6)],
    2: [([7, 8, 9, 10, 11, 12], 8), ([250], 6), ([1, 2], 3)],
    4: [([3, 4, 5, 6, 7], 2)],
}


def _engine(model_dir: Path, pad: bool, **kw: Any) -> LLMEngine:
    config = EngineConfig(block_size=4, num_kv_blocks=40, max_num_seqs=8, max_num_batched_tokens=6,
                          enable_prefix_caching=False, pad_decode_steps=pad, **kw)
    return LLMEngine(str(model_dir), config)


def _step_both(model_dir: Path, arrivals: Arrivals, steps: int, **kw: Any) -> dict[str, object]:
    """Run both engines in lock step; assert equal outputs and pool bytes each step; what was seen."""
    plain, padded = _engine(model_dir, False, **kw), _engine(model_dir, True, **kw)
    graphs = padded.runner.decode_graphs
    assert plain.runner.decode_graphs is None and graphs is not None
    n = plain.runner.num_blocks
    assert padded.runner.num_blocks == n and padded.runner.kv_cache.shape[1] == n + 1  # + scratch
    assert padded.kv.num_blocks == n
    buckets, ptrs, partial, unsampled, eager = set(), set(), 0, 0, 0
    for step in range(steps):
        for prompt, max_tokens in arrivals.get(step, []):
            for engine in (plain, padded):
                engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0))
        before = graphs.last
        want, got = plain.step(), padded.step()
        assert [(o.request_id, o.token_ids, o.finished) for o in got] == \
               [(o.request_id, o.token_ids, o.finished) for o in want], step
        assert torch.equal(padded.runner.kv_cache[:, :n], plain.runner.kv_cache), step
        if plain.runner.kv_scales is not None:
            assert padded.runner.kv_scales is not None
            assert torch.equal(padded.runner.kv_scales[:, :n], plain.runner.kv_scales), step
        last = graphs.last
        if last is None or last is before:
            eager += 1
            continue
        buckets.add(last.bucket)
        partial += last.num_real < last.bucket
        unsampled += len(got) < last.num_real
        ptrs.add(tuple(t.data_ptr() for t in (last.input_ids, last.positions, last.meta.slot_mapping,
                                               last.meta.seq_lens, last.meta.block_tables,
                                               last.meta.query_start_loc)))
    assert not plain.has_unfinished() and not padded.has_unfinished()
    assert padded.runner.kv_cache[:, n].float().abs().sum() > 0  # pad rows wrote the scratch block
    assert len(ptrs) == 1  # every bucket's views start at the same static buffers, every step
    return {"buckets": buckets, "partial": partial, "unsampled": unsampled, "eager": eager,
            "graphs": graphs}


@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_padded_decode_steps_equal_unpadded(tiny_model_dir: Path, backend: str) -> None:
    seen = _step_both(tiny_model_dir, ARRIVALS, 12, attention_backend=backend)
    assert seen["buckets"] == {1, 4, 8}
    assert seen["partial"] and seen["unsampled"] and seen["eager"]


def test_triton_fp8_padded_decode_steps_equal_unpadded(tiny_model_dir: Path) -> None:
    """The Triton backend planned once per bucket (``prepare_capture``, as for a capture): its tiles
    kept, its fp8 block writes computed from the static buffers in every forward."""
    arrivals: Arrivals = {0: [([5, 17, 3], 3), ([11, 12], 2)], 1: [([250], 2)]}
    seen = _step_both(tiny_model_dir, arrivals, 4, attention_backend="triton", kv_cache_dtype="fp8")
    graphs = seen["graphs"]
    assert isinstance(graphs, DecodeGraphRunner)
    assert seen["buckets"] == {2, 4} and seen["partial"]
    backends = [b.backend for b in graphs.buckets.values()]
    assert all(isinstance(b, TritonAttentionBackend) and b is not graphs.backend for b in backends)
    assert len({id(b) for b in backends}) == len(backends)  # one planned instance per bucket


def test_handles_only_pure_decode_steps_that_fit(tiny_model_dir: Path) -> None:
    graphs = _engine(tiny_model_dir, True).runner.decode_graphs
    assert graphs is not None and graphs.buffers.buckets == (1, 2, 4, 8)
    width = graphs.buffers.block_tables.shape[1]

    def plan(query_lens: list[int], tables: list[list[int]] | None = None) -> StepPlan:
        tokens = sum(query_lens)
        return StepPlan([0] * tokens, [0] * tokens, query_lens, [4] * len(query_lens),
                        tables or [[1]] * len(query_lens), list(range(len(query_lens))))

    assert graphs.handles(plan([1, 1, 1])) == 4
    assert graphs.handles(plan([1] * 8)) == 8
    assert graphs.handles(plan([1] * 9)) is None  # past the largest bucket
    assert graphs.handles(plan([1, 3])) is None  # a prefill chunk: eager
    assert graphs.handles(plan([1], [[1] * (width + 1)])) is None  # wider than the static tables


def test_graph_mode_choice(caplog: pytest.LogCaptureFixture) -> None:
    triton, torch_ref = TritonAttentionBackend(), TorchAttentionBackend()
    assert graph_mode(EngineConfig(), torch_ref) is None
    assert graph_mode(EngineConfig(pad_decode_steps=True), torch_ref) == "padded"
    assert graph_mode(EngineConfig(device="cuda"), triton) == "capture"
    assert graph_mode(EngineConfig(device="cuda", enforce_eager=True), triton) is None
    assert graph_mode(EngineConfig(device="cuda", tensor_parallel_size=2), triton) is None
    with caplog.at_level(logging.WARNING, logger="engine.graph_runner"):
        assert graph_mode(EngineConfig(device="cuda"), torch_ref) is None
        # experts kept as records route on the host (tests/unit/test_triton_blocks.py: host_synced)
        assert graph_mode(EngineConfig(device="cuda"), triton, host_synced=True) is None
    assert "TorchAttentionBackend cannot be captured" in caplog.text
    assert "routed on the host" in caplog.text


def test_device_block_writes_equal_the_host_plan() -> None:
    graphs = DecodeGraphs(max_num_seqs=8, max_blocks_per_seq=6, block_size=4, scratch_block=30, device="cpu")
    padded = graphs.pad([1, 2, 3], [10, 4, 17], [11, 5, 18], [[3, 9, 1], [0, 4], [7, 8, 10, 11, 12]])
    assert padded is not None and padded.bucket == 4
    want = torch.tensor(plan_block_writes(padded.meta), dtype=torch.int32).t()
    assert want[0].tolist() == [1, 4, 12, 30]  # the pad row's block is the scratch block
    assert torch.equal(decode_block_writes(padded.meta), want)


def test_flashinfer_graph_write_rows_land_where_the_reference_writes() -> None:
    """flashinfer's captured forward writes K/V at rows computed from the static slot mapping."""
    graphs = DecodeGraphs(max_num_seqs=8, max_blocks_per_seq=6, block_size=4, scratch_block=30, device="cpu")
    padded = graphs.pad([1, 2, 3], [10, 4, 17], [11, 5, 18], [[3, 9, 1], [0, 4], [7, 8, 10, 11, 12]])
    assert padded is not None
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(4, n, 16, generator=gen) for n in (4, 2, 2))
    want, got = torch.zeros(31, 2, 4, 2, 16), torch.zeros(31, 2, 4, 2, 16)
    reference = TorchAttentionBackend()
    reference.prepare(padded.meta)
    reference.forward(q, k, v, want, 0.25)
    rows, at = got.view(-1, 2, 16), write_rows(padded.meta.slot_mapping, 4)
    rows.index_copy_(0, at, k)
    rows.index_copy_(0, at + 4, v)
    assert torch.equal(got, want) and want[30].abs().sum() > 0  # the pad row's K/V: the scratch block

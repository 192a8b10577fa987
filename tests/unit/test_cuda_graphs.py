"""Decode padding into static buffers (engine/cuda_graphs.py), run eagerly on CPU: buckets, stable
buffers, padded attention that gives the real rows exactly what unpadded attention gives, and a
padded model step within float rounding of the unpadded one (GEMM blocking depends on the row count)."""

from __future__ import annotations

import pytest
import torch

from engine.buckets import decode_buckets, padded_batch_size
from engine.cuda_graphs import DecodeGraphs
from engine.kv_tensors import allocate_kv_cache
from engine.models.causal_lm import CausalLM
from kernels import TorchAttentionBackend
from kernels.attention import AttentionMetadata
from tests.unit.test_model_tiny import hf_model, model_config

BLOCK_SIZE, NUM_BLOCKS = 4, 24
SCRATCH = NUM_BLOCKS  # one block past the pool's last


def test_buckets() -> None:
    assert decode_buckets(1) == (1, 2, 4, 8)
    assert decode_buckets(20) == (1, 2, 4, 8, 16, 24)
    assert decode_buckets(256)[-3:] == (240, 248, 256)
    assert decode_buckets(4096)[-1] == 512
    assert decode_buckets(100, cap=12) == (1, 2, 4, 8, 12)
    buckets = decode_buckets(64)
    assert [padded_batch_size(n, buckets) for n in (1, 3, 5, 9, 17, 64)] == [1, 4, 8, 16, 24, 64]
    assert padded_batch_size(65, buckets) is None
    with pytest.raises(ValueError):
        padded_batch_size(0, buckets)


def test_graphs_off_with_enforce_eager_or_on_cpu() -> None:
    assert not DecodeGraphs(8, 4, BLOCK_SIZE, SCRATCH, "cpu").enabled
    assert not DecodeGraphs(8, 4, BLOCK_SIZE, SCRATCH, "meta", enforce_eager=True).enabled


@torch.inference_mode()
def test_padded_decode_equals_unpadded_and_buffers_stay_put() -> None:
    hf = hf_model("llama3")
    config = model_config(hf.config)
    model = CausalLM(config, torch.float32)
    model.load_weights(hf.state_dict().items())
    gen = torch.Generator().manual_seed(0)
    base = allocate_kv_cache(config, NUM_BLOCKS + 1, BLOCK_SIZE, torch.float32, "cpu")
    base.copy_(torch.randn(base.shape, generator=gen))
    graphs = DecodeGraphs(max_num_seqs=8, max_blocks_per_seq=6, block_size=BLOCK_SIZE, scratch_block=SCRATCH,
                          device="cpu")
    tables = [[3, 9, 1, 2], [0, 4], [7, 8, 10, 11, 12]]
    seq_lens = [11, 5, 18]
    ptrs: set[tuple[int, ...]] = set()
    for step in range(3):
        lens = [s + step for s in seq_lens]
        ids = torch.randint(0, config.vocab_size, (3,), generator=gen).tolist()
        positions = [s - 1 for s in lens]
        plain_kv, padded_kv = base.clone(), base.clone()
        meta = AttentionMetadata.build(BLOCK_SIZE, [1, 1, 1], lens, tables)
        backend = TorchAttentionBackend()
        backend.prepare(meta)
        want = model(torch.tensor(ids), torch.tensor(positions), plain_kv, backend, meta)
        padded = graphs.pad(ids, positions, lens, tables)
        assert padded is not None and padded.bucket == 4 and padded.num_real == 3
        buffers = (padded.input_ids, padded.positions, padded.meta.slot_mapping, padded.meta.seq_lens,
                   padded.meta.block_tables, padded.meta.query_start_loc)
        ptrs.add(tuple(t.data_ptr() for t in buffers))
        backend = TorchAttentionBackend()
        backend.prepare(padded.meta)
        got = model(padded.input_ids, padded.positions, padded_kv, backend, padded.meta)
        torch.testing.assert_close(got[:3], want, atol=1e-5, rtol=1e-5)
        assert torch.equal(model.compute_logits(got[:3]).argmax(-1), model.compute_logits(want).argmax(-1))
        # the pad row wrote only into the scratch block
        torch.testing.assert_close(padded_kv[:, :NUM_BLOCKS], plain_kv[:, :NUM_BLOCKS], atol=1e-5, rtol=1e-5)
        assert torch.equal(padded_kv[:, :NUM_BLOCKS] != base[:, :NUM_BLOCKS],
                           plain_kv[:, :NUM_BLOCKS] != base[:, :NUM_BLOCKS])
        assert not torch.equal(padded_kv[:, SCRATCH], base[:, SCRATCH])
    assert len(ptrs) == 1


@pytest.mark.parametrize("backend_name", ["torch", "triton"])
def test_padded_attention_rows_are_exact(backend_name: str) -> None:
    from kernels import get_attention_backend

    gen = torch.Generator().manual_seed(2)
    kv = torch.randn(NUM_BLOCKS + 1, 2, BLOCK_SIZE, 2, 16, generator=gen)
    q, k, v = (torch.randn(3, n, 16, generator=gen) for n in (6, 2, 2))
    tables, lens = [[3, 9, 1], [0, 4], [7, 8, 10, 11, 12]], [11, 5, 18]
    graphs = DecodeGraphs(8, 6, BLOCK_SIZE, SCRATCH, "cpu")
    padded = graphs.pad([0, 0, 0], [s - 1 for s in lens], lens, tables)
    assert padded is not None
    outs = []
    for meta, rows in ((AttentionMetadata.build(BLOCK_SIZE, [1, 1, 1], lens, tables), 3), (padded.meta, 4)):
        backend = get_attention_backend("cpu", backend_name)
        backend.prepare(meta)
        pq, pk, pv = (torch.cat([t, t[:1].expand(rows - 3, -1, -1)]) for t in (q, k, v))
        outs.append(backend.forward(pq, pk, pv, kv.clone(), 0.25)[:3])
    assert torch.equal(outs[0], outs[1])


def test_pad_refuses_what_does_not_fit() -> None:
    graphs = DecodeGraphs(max_num_seqs=2, max_blocks_per_seq=2, block_size=BLOCK_SIZE, scratch_block=SCRATCH,
                          device="cpu")
    assert graphs.pad([1, 2, 3], [0, 0, 0], [1, 1, 1], [[0], [1], [2]]) is not None  # bucket 4 (2 -> 8)
    assert graphs.pad([1], [8], [9], [[0, 1, 2]]) is None  # wider than the static table

"""Decode-step bookkeeping for CUDA graphs: buckets, static input buffers, padding.

A captured graph replays fixed device addresses and shapes, so a decode step is padded
to its bucket (``engine/buckets.py``) and its inputs are copied into buffers allocated
once for the largest bucket. Invariants, each tested on CPU:

* the buffers never move: every step's views share the same ``data_ptr`` per bucket;
* pad rows are harmless: a pad row is a one-token sequence at position 0 whose only
  block is the *scratch block* (an extra block past the pool's last one, never handed
  to a request), so its K/V write lands there and it reads nothing else;
* real rows come out of padded attention bit for bit as out of unpadded attention (rows
  are independent); through the whole model they agree to float rounding only, since a
  GEMM's blocking (on CPU and in cuBLAS alike) may depend on the number of rows (on
  the CPUs here the default prepacked linear kernel does not, and the engine's KV
  bytes through the padded path equal the unpadded ones exactly; ``F.linear`` does).

``enforce_eager`` (or a non-CUDA device) turns graphs off: ``DecodeGraphs.enabled`` is
False. Capture and replay, and the ``ModelRunner`` hook, live in ``engine/graph_runner.py``
(which also runs this padding without capture under ``pad_decode_steps``: that is how the
CPU tests check it inside the engine). Checked on CPU: all of the above, and the engine's
tokens and KV bytes through the padded path. Only a GPU can check the capture itself
(``tests/gpu/test_cuda_graphs_cuda.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.buckets import decode_buckets, padded_batch_size
from kernels.attention import AttentionMetadata


@dataclass
class PaddedDecode:
    """One decode step in static buffers: ``num_real`` real rows, then pad rows up to ``bucket``."""

    bucket: int
    num_real: int
    input_ids: torch.Tensor  # int64 [bucket]
    positions: torch.Tensor  # int64 [bucket]
    meta: AttentionMetadata


class DecodeGraphs:
    """Static decode inputs for every bucket up to ``max_num_seqs``."""

    def __init__(self, max_num_seqs: int, max_blocks_per_seq: int, block_size: int, scratch_block: int,
                 device: torch.device | str, enforce_eager: bool = False) -> None:
        self.buckets = decode_buckets(max_num_seqs)
        self.block_size = block_size
        self.scratch_block = scratch_block
        self.device = torch.device(device)
        self.enabled = self.device.type == "cuda" and not enforce_eager
        top, width = self.buckets[-1], max_blocks_per_seq
        self.input_ids = torch.zeros(top, dtype=torch.int64, device=self.device)
        self.positions = torch.zeros(top, dtype=torch.int64, device=self.device)
        self.slot_mapping = torch.zeros(top, dtype=torch.int64, device=self.device)
        self.query_start_loc = torch.arange(top + 1, dtype=torch.int32, device=self.device)
        self.seq_lens = torch.ones(top, dtype=torch.int32, device=self.device)
        self.block_tables = torch.zeros(top, width, dtype=torch.int32, device=self.device)

    def bucket_for(self, num_seqs: int) -> int | None:
        return padded_batch_size(num_seqs, self.buckets)

    def pad(self, input_ids: list[int], positions: list[int], seq_lens: list[int],
            block_tables: list[list[int]]) -> PaddedDecode | None:
        """Copy one decode step (one token per sequence) into the buffers; ``None`` if no bucket fits."""
        bucket = self.bucket_for(len(input_ids))
        if bucket is None or any(len(t) > self.block_tables.shape[1] for t in block_tables):
            return None
        return self._fill(bucket, input_ids, positions, seq_lens, block_tables)

    def pad_only(self, bucket: int) -> PaddedDecode:
        """Fill the buffers of ``bucket`` with pad rows alone (what a graph is captured on: its warm-up
        and capture runs write nothing but the scratch block)."""
        if bucket not in self.buckets:
            raise ValueError(f"{bucket} is not a bucket ({self.buckets})")
        return self._fill(bucket, [], [], [], [])

    def _fill(self, bucket: int, input_ids: list[int], positions: list[int], seq_lens: list[int],
              block_tables: list[list[int]]) -> PaddedDecode:
        n = len(input_ids)
        pad = bucket - n
        bs = self.block_size
        lens = list(seq_lens) + [1] * pad
        tables = [list(t) for t in block_tables] + [[self.scratch_block]] * pad
        slots = [t[(s - 1) // bs] * bs + (s - 1) % bs for t, s in zip(tables, lens, strict=True)]
        # only the columns some row uses: no kernel reads a table past its sequence's last block, so
        # what earlier steps left further right is never seen
        width = max(len(t) for t in tables)
        host_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
        self.input_ids[:bucket].copy_(torch.tensor(list(input_ids) + [0] * pad), non_blocking=True)
        self.positions[:bucket].copy_(torch.tensor(list(positions) + [0] * pad), non_blocking=True)
        self.slot_mapping[:bucket].copy_(torch.tensor(slots), non_blocking=True)
        self.seq_lens[:bucket].copy_(torch.tensor(lens, dtype=torch.int32), non_blocking=True)
        self.block_tables[:bucket, :width].copy_(host_tables, non_blocking=True)
        meta = AttentionMetadata(
            block_size=bs,
            slot_mapping=self.slot_mapping[:bucket],
            query_start_loc=self.query_start_loc[: bucket + 1],
            seq_lens=self.seq_lens[:bucket],
            block_tables=self.block_tables[:bucket],
            query_lens_list=[1] * bucket,
            seq_lens_list=lens,
            block_tables_list=tables,
        )
        return PaddedDecode(bucket, n, self.input_ids[:bucket], self.positions[:bucket], meta)

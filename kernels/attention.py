"""Attention over paged KV: the per-step metadata and the backend interface.

KV layout (shared by every backend and by ``transfer/``): one contiguous tensor
for all layers, ``kv[layer]`` of shape ``[num_blocks, 2, block_size, num_kv_heads,
head_dim]`` (index 0 of dim 1 is K, 1 is V). This is flashinfer's NHD paged
layout per layer, and one block of one layer is a single contiguous region, so a
transfer moves ``num_layers`` regions per block.

A step processes a flat batch of ``num_tokens`` new tokens from ``num_seqs``
sequences, sequence by sequence (queries of sequence ``s`` are rows
``query_start_loc[s]:query_start_loc[s+1]``). Sequence ``s`` has ``seq_lens[s]``
tokens in total after this step, of which the last ``q_len`` are new; new token
``i`` sits at position ``seq_lens[s] - q_len + i`` and attends causally to every
key at a position <= its own. A decode is ``q_len == 1``; a prefill chunk is any
``q_len`` with earlier tokens already in the cache. ``slot_mapping[t]`` is where
token ``t``'s K/V goes: ``block_id * block_size + offset``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch


@dataclass
class AttentionMetadata:
    """Everything a backend needs for one step; built once by the engine."""

    block_size: int
    slot_mapping: torch.Tensor  # int64 [num_tokens]
    query_start_loc: torch.Tensor  # int32 [num_seqs + 1]
    seq_lens: torch.Tensor  # int32 [num_seqs]
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks_per_seq], padded with 0
    # Host copies, so CPU backends and planners never synchronise with a device.
    query_lens_list: list[int]
    seq_lens_list: list[int]
    block_tables_list: list[list[int]]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_list)

    @property
    def num_tokens(self) -> int:
        return int(sum(self.query_lens_list))

    @property
    def is_pure_decode(self) -> bool:
        return all(q == 1 for q in self.query_lens_list)

    @staticmethod
    def build(
        block_size: int,
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        device: torch.device | str = "cpu",
    ) -> AttentionMetadata:
        """Build metadata (and slot mapping) from host lists."""
        if not (len(query_lens) == len(seq_lens) == len(block_tables)):
            raise ValueError("query_lens, seq_lens and block_tables must have one entry per sequence")
        slots: list[int] = []
        for q_len, s_len, table in zip(query_lens, seq_lens, block_tables, strict=True):
            if q_len < 1 or q_len > s_len:
                raise ValueError(f"bad lengths: q_len={q_len} seq_len={s_len}")
            if len(table) * block_size < s_len:
                raise ValueError(f"block table too short: {len(table)} blocks for {s_len} tokens")
            for pos in range(s_len - q_len, s_len):
                slots.append(table[pos // block_size] * block_size + pos % block_size)
        width = max((len(t) for t in block_tables), default=0)
        padded = [t + [0] * (width - len(t)) for t in block_tables]
        starts = [0]
        for q_len in query_lens:
            starts.append(starts[-1] + q_len)
        return AttentionMetadata(
            block_size=block_size,
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_tables=torch.tensor(padded, dtype=torch.int32, device=device).reshape(len(padded), width),
            query_lens_list=list(query_lens),
            seq_lens_list=list(seq_lens),
            block_tables_list=[list(t) for t in block_tables],
        )


ATTENTION_FEATURES = frozenset({"window", "sinks", "softcap"})


class AttentionBackend(Protocol):
    """Two methods: plan once per step, then run every layer.

    ``forward`` first writes the step's new ``k``/``v`` (``[num_tokens, kv_heads,
    head_dim]``) into ``kv_layer`` at ``meta.slot_mapping``, then returns the
    attention output ``[num_tokens, num_heads, head_dim]`` for ``q``
    (``[num_tokens, num_heads, head_dim]``) over the paged cache, causal as the
    module docstring describes, with softmax scale ``scale``. GQA: query head
    ``h`` reads KV head ``h // (num_heads // num_kv_heads)``.

    A quantized ``kv_layer`` (fp8/int8, see ``kernels/kv_quant.py``) comes with
    ``kv_scales`` (``[num_blocks, 2, kv_heads]`` float32), which the write updates.

    Per-layer features (keyword-only; fixed for a layer, so a captured CUDA graph stays right):

    - ``window`` W: the query at position ``p`` attends only to keys at positions ``p - W + 1 .. p``
      (W keys, itself included: Hugging Face's ``sliding_window``);
    - ``softcap`` c: each scaled score ``s`` becomes ``c * tanh(s / c)`` before masking;
    - ``sinks``: float32 ``[num_heads]`` (this rank's query heads), one learned logit per query head
      that joins the softmax's denominator and has no value (gpt-oss).

    ``features`` names those a backend's own kernels compute; every backend accepts all three, and
    one whose kernels lack a feature hands such a layer to the torch reference (never a wrong answer).
    """

    features: frozenset[str]

    def prepare(self, meta: AttentionMetadata) -> None: ...

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_layer: torch.Tensor,
        scale: float,
        kv_scales: torch.Tensor | None = None,
        *,
        window: int | None = None,
        sinks: torch.Tensor | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor: ...


@runtime_checkable
class CapturableBackend(AttentionBackend, Protocol):
    """A backend whose pure-decode steps can be captured in a CUDA graph and replayed.

    The decode-graph runner (``engine/graph_runner.py``) takes one instance per bucket from
    ``capture_instance()`` (sharing any large scratch memory, such as flashinfer's workspace:
    graphs never run concurrently). ``prepare_capture(meta)`` plans that instance once for a
    decode bucket (every query one token) whose metadata tensors are static buffers
    (``engine/cuda_graphs.py``): their values change from step to step, their addresses and
    the bucket never do. After it, ``forward`` reads the step only through those tensors and
    arrays the backend keeps at fixed addresses: no host lists, no host-to-device copies, no
    allocation that depends on the values, so the forward captured once is right for every
    later step of the bucket. ``prepare_replay(meta)`` runs on the host before each replay
    (outside the graph) and may refill the backend's own fixed arrays from the step's
    metadata; ``prepare`` is never called on such an instance.
    """

    def capture_instance(self) -> CapturableBackend: ...

    def prepare_capture(self, meta: AttentionMetadata) -> None: ...

    def prepare_replay(self, meta: AttentionMetadata) -> None: ...

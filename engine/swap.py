"""Swap preemption: a preempted request's KV blocks go to host memory and come back on resume.

``--preemption-mode swap`` makes the scheduler call ``swap_out`` instead of
dropping a preempted request's K/V: the rows of its computed tokens (every layer,
K and V, plus the scales of a quantized cache) are copied into host
tensors owned by this class, its device blocks are freed, and it keeps its
``num_computed_tokens``. When it is scheduled again it gets fresh blocks and
``swap_in`` copies the rows back before the step runs, so nothing is recomputed
and the K/V are bit-identical to what they were.

The host space is bounded by ``capacity_bytes``; a request that does not fit is
preempted by recompute instead (``swap_out`` returns False).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class _Swapped:
    kv: torch.Tensor  # [layers, n_blocks, 2, block_size, kv_heads, head_dim] on the host
    scales: torch.Tensor | None  # [layers, n_blocks, 2, kv_heads]

    @property
    def nbytes(self) -> int:
        extra = self.scales.numel() * self.scales.element_size() if self.scales is not None else 0
        return self.kv.numel() * self.kv.element_size() + extra


class HostSwapSpace:
    def __init__(self, kv_cache: torch.Tensor, kv_scales: torch.Tensor | None, capacity_bytes: int) -> None:
        self.kv_cache = kv_cache
        self.kv_scales = kv_scales
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self.num_swap_outs = 0
        self.num_swap_ins = 0
        self.bytes_swapped = 0
        self._entries: dict[str, _Swapped] = {}

    def holds(self, request_id: str) -> bool:
        return request_id in self._entries

    def swap_out(self, request_id: str, block_ids: list[int]) -> bool:
        """Copy ``block_ids`` (in order) to the host; False (nothing kept) when they do not fit."""
        index = torch.tensor(block_ids, dtype=torch.int64, device=self.kv_cache.device)
        per_block = self.kv_cache[:, :1].numel() * self.kv_cache.element_size()
        if self.kv_scales is not None:
            per_block += self.kv_scales[:, :1].numel() * self.kv_scales.element_size()
        if self.used_bytes + per_block * len(block_ids) > self.capacity_bytes:
            return False
        kv = _take(self.kv_cache, index).to("cpu")
        scales = self.kv_scales.index_select(1, index).to("cpu") if self.kv_scales is not None else None
        entry = _Swapped(kv, scales)
        self._entries[request_id] = entry
        self.used_bytes += entry.nbytes
        self.num_swap_outs += 1
        self.bytes_swapped += entry.nbytes
        return True

    def swap_in(self, request_id: str, block_ids: list[int]) -> None:
        """Copy a swapped request's rows into its new blocks (the first ``len(swapped)`` of them)."""
        entry = self._entries.pop(request_id)
        self.used_bytes -= entry.nbytes
        n = entry.kv.shape[1]
        index = torch.tensor(block_ids[:n], dtype=torch.int64, device=self.kv_cache.device)
        _put(self.kv_cache, index, entry.kv.to(self.kv_cache.device))
        if self.kv_scales is not None and entry.scales is not None:
            self.kv_scales.index_copy_(1, index, entry.scales.to(self.kv_scales.device))
        self.num_swap_ins += 1
        self.bytes_swapped += entry.nbytes

    def discard(self, request_id: str) -> None:
        entry = self._entries.pop(request_id, None)
        if entry is not None:
            self.used_bytes -= entry.nbytes


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t


def _take(cache: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return _bytes(cache).index_select(1, index).view(cache.dtype)


def _put(cache: torch.Tensor, index: torch.Tensor, rows: torch.Tensor) -> None:
    _bytes(cache).index_copy_(1, index, _bytes(rows))

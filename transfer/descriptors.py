"""The descriptor arithmetic of a KV read: pure functions over layouts and numpy arrays, no NIXL.

- A KV cache ``[layers, blocks, K/V, tokens, heads, head_dim]`` is registered as one descriptor per
  (layer, block) region, layer-major: ``region_table`` lists them as ``(address, length, device)`` rows;
  a quantized cache's scale regions follow the K/V regions in the same order (row ``count + i`` is the
  scales of row ``i``).
- A read of every layer of ``remote_blocks[i]`` into ``local_blocks[i]`` picks rows of the source's and
  the sink's tables by index (``region_indices``), so both lists are prepared once per peer and each
  read only indexes them. With ``slots`` (a hybrid model's KV groups, ``engine/kv_groups.py``), pair
  ``i`` moves only its group's first ``slots[i]`` layers.
- NIXL merges consecutive rows that are contiguous on both sides into one descriptor;
  ``merged_descriptor_count`` counts what a read then posts.
- Block ids outside ``[0, num_blocks)`` are refused before anything is posted (``check_block_range``).
"""

from __future__ import annotations

import numpy as np

from transfer.wire import KvLayout


def region_table(base_addr: int, layout: KvLayout, device_id: int, scales_addr: int = 0) -> np.ndarray:
    """Nx3 ``(address, length, device)`` rows for every (layer, block) region, layer-major, then the
    scale regions (when the layout has them) in the same order."""
    count = layout.num_layers * layout.num_blocks
    parts = 2 if layout.scale_region_bytes else 1
    table = np.empty((parts * count, 3), dtype=np.uint64)
    index = np.arange(count, dtype=np.uint64)
    table[:count, 0] = base_addr + index * np.uint64(layout.region_bytes)
    table[:count, 1] = layout.region_bytes
    if parts == 2:
        table[count:, 0] = scales_addr + index * np.uint64(layout.scale_region_bytes)
        table[count:, 1] = layout.scale_region_bytes
    table[:, 2] = device_id
    return table


def region_indices(sink: KvLayout, source: KvLayout, remote_blocks: np.ndarray, local_blocks: np.ndarray,
                   slots: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``(source rows, sink rows)`` of the two ``region_table`` s that read every layer (or the first
    ``slots[i]``) of ``remote_blocks[i]`` into ``local_blocks[i]``, layer by layer (then the scale rows
    likewise), as the int32 index arrays NIXL takes."""
    layers = np.arange(sink.num_layers, dtype=np.int64)[:, None]
    remote_idx = layers * source.num_blocks + remote_blocks[None, :]
    local_idx = layers * sink.num_blocks + local_blocks[None, :]
    if slots is None:
        remote_idx, local_idx = remote_idx.ravel(), local_idx.ravel()
    else:
        keep = layers < slots[None, :]
        remote_idx, local_idx = remote_idx[keep], local_idx[keep]
    if sink.scale_region_bytes:  # the scale regions follow the K/V regions in both tables
        remote_idx = np.concatenate((remote_idx, remote_idx + sink.num_layers * source.num_blocks))
        local_idx = np.concatenate((local_idx, local_idx + sink.num_layers * sink.num_blocks))
    return remote_idx.astype(np.int32), local_idx.astype(np.int32)


def pair_layers(layout: KvLayout, count: int, slots: np.ndarray | None) -> int:
    """Layer regions a read of ``count`` block pairs moves (every layer, or ``slots`` of each)."""
    return count * layout.num_layers if slots is None else int(slots.sum())


def merged_descriptor_count(local_idx: np.ndarray, remote_idx: np.ndarray) -> int:
    """Descriptors after merging runs that are contiguous on both sides (as NIXL does)."""
    if len(local_idx) == 0:
        return 0
    contiguous = (np.diff(local_idx) == 1) & (np.diff(remote_idx) == 1)
    return int(len(local_idx) - np.count_nonzero(contiguous))


def check_block_range(side: str, blocks: np.ndarray, num_blocks: int) -> None:
    """``ValueError`` naming ``side`` when a block id lies outside ``[0, num_blocks)``."""
    if blocks.size and (blocks.min() < 0 or blocks.max() >= num_blocks):
        raise ValueError(f"{side} block id out of range [0, {num_blocks}): {blocks.tolist()}")

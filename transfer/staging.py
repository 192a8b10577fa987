"""Staged reads: a source rank's whole block regions into a staging buffer, then its heads into the cache.

Where a decode rank's KV heads differ from a source rank's (different tensor-parallel sizes), each
token row of the NHD cache (``[layers, blocks, K/V, tokens, heads, head_dim]``) holds another set of
heads on each side, so the heads a sink needs are not contiguous on both sides at once. ``KvSink``
then READs the source rank's whole regions (contiguous there: one descriptor per (layer, run of
consecutive blocks), the same as between equal head ranges) into one staging buffer registered with
NIXL once, and copies the needed heads of every token row into its cache with one strided ``torch``
copy per head run and chunk. A source rank holding more heads than the sink needs (1:2) costs the
extra bytes of its other heads; one holding only needed heads (2:1) costs none. The local copy is the
price either way.

Pure arithmetic and copies over tensors here; ``transfer/nixl_sink.py`` posts the READs.

- The staging buffer is laid out ``[layers, chunk blocks, K/V, tokens, source heads, head_dim]``: chunk
  block ``j`` of layer ``l`` at ``(l * chunk + j) * source region_bytes``.
- ``chunks(n, blocks_per_chunk)``: a read of ``n`` blocks goes in slices of at most
  ``blocks_per_chunk`` (``staging_bytes // (layers * source region_bytes)``) blocks, in order.
- ``read_tables``: the merged ``(address, length, device)`` descriptors of one chunk, both sides.
- ``copy_heads``: the chunk's needed heads from staging into the cache's local blocks.
"""

from __future__ import annotations

import numpy as np
import torch

from transfer.heads import HeadRun
from transfer.wire import KvLayout

DEFAULT_STAGING_BYTES = 32 * 1024**2  # 32 MiB: 66 blocks of 16 tokens of SmolLM2-sized KV (fp32, 2 heads)


def blocks_per_chunk(src: KvLayout, staging_bytes: int) -> int:
    """How many of ``src``'s blocks (every layer) fit the staging buffer; ``ValueError`` when none does."""
    per_block = src.num_layers * src.region_bytes
    if staging_bytes < per_block:
        raise ValueError(f"staging_bytes {staging_bytes} is below one block of every layer of the KV "
                         f"source ({per_block} bytes)")
    return staging_bytes // per_block


def chunks(n: int, per_chunk: int) -> list[slice]:
    """The slices of a read of ``n`` blocks, ``per_chunk`` blocks at most each, in order."""
    return [slice(start, min(start + per_chunk, n)) for start in range(0, n, per_chunk)]


def merged(local: np.ndarray, remote: np.ndarray, length: int, local_device: int,
           remote_device: int) -> tuple[np.ndarray, np.ndarray]:
    """Nx3 ``(address, length, device)`` tables of regions of ``length`` bytes at ``local[i]`` /
    ``remote[i]``, where consecutive regions contiguous on both sides are merged into one descriptor."""
    if len(local) == 0:
        empty = np.empty((0, 3), dtype=np.uint64)
        return empty, empty.copy()
    step = np.uint64(length)
    joined = (np.diff(local) == step) & (np.diff(remote) == step)
    starts = np.flatnonzero(np.concatenate(([True], ~joined)))
    lengths = np.diff(np.append(starts, len(local))).astype(np.uint64) * step
    tables = []
    for addrs, device in ((local, local_device), (remote, remote_device)):
        table = np.empty((len(starts), 3), dtype=np.uint64)
        table[:, 0] = addrs[starts]
        table[:, 1] = lengths
        table[:, 2] = device
        tables.append(table)
    return tables[0], tables[1]


def read_tables(staging_addr: int, staging_device: int, src: KvLayout, src_base: int, src_device: int,
                remote_blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(staging side, source side)`` descriptors reading every layer's region of ``remote_blocks`` (one
    chunk) into staging, merged where contiguous on both sides (a run of consecutive blocks is one)."""
    n = len(remote_blocks)
    region = np.uint64(src.region_bytes)
    layers = np.arange(src.num_layers, dtype=np.uint64)[:, None]
    slots = layers * np.uint64(n) + np.arange(n, dtype=np.uint64)[None, :]
    local = np.uint64(staging_addr) + slots * region
    remote = np.uint64(src_base) + (layers * np.uint64(src.num_blocks)
                                    + remote_blocks.astype(np.uint64)[None, :]) * region
    return merged(local.ravel(), remote.ravel(), src.region_bytes, staging_device, src_device)


def copy_heads(cache: torch.Tensor, staging: torch.Tensor, src: KvLayout, dst: KvLayout, runs: list[HeadRun],
               local_blocks: np.ndarray) -> None:
    """Copy each run's global heads of the chunk in ``staging`` (``src``'s heads, laid out as above) into
    ``local_blocks`` of ``cache`` (``dst``'s heads): one strided copy per run."""
    n = len(local_blocks)
    count = src.num_layers * n * src.region_bytes // src.element_size
    staged = staging[: count * src.element_size].view(cache.dtype).view(
        src.num_layers, n, 2, src.block_size, src.num_kv_heads, src.head_dim)
    index = torch.as_tensor(local_blocks, dtype=torch.int64, device=cache.device)
    for run in runs:
        source_heads = slice(run.start - src.kv_head_start, run.stop - src.kv_head_start)
        sink_heads = slice(run.start - dst.kv_head_start, run.stop - dst.kv_head_start)
        cache[:, :, :, :, sink_heads].index_copy_(1, index, staged[:, :, :, :, source_heads])

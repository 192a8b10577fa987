"""What one read moves, worked out before anything is posted: checks and byte arithmetic, no NIXL call.

``plan_read(handle, remote, sink, remote_block_ids, local_block_ids, staging, backend, slots)``:

- refuses a handle whose compatibility hash is not its source's (``IncompatibleKvError``), block lists of
  different lengths and block ids out of range on either side (``ValueError``);
- for each source rank whose heads equal this rank's, the rows of the two prepared descriptor lists
  (``ReadPlan.direct``; ``transfer/descriptors.py``), each pair moving every layer or, with ``slots``,
  its KV group's first ``slots[i]``; for each rank read by staging, its chunks (``ReadPlan.staged``;
  ``transfer/staging_buffer.py``: every layer, so a hybrid model's groups are refused there);
- ``ReadPlan.stats``: ``bytes`` counts the KV bytes placed in the cache, ``staged_bytes`` what the
  staged READs move (more when the source rank holds heads this rank does not need), ``descriptors``
  the merged descriptors posted; ``seconds`` is filled in when the read ends.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from transfer.descriptors import check_block_range, merged_descriptor_count, pair_layers, region_indices
from transfer.errors import IncompatibleKvError
from transfer.sink_handshake import Peer, Remote
from transfer.staging_buffer import StagedChunk, StagingBuffer
from transfer.wire import KvHandle, KvLayout, TransferStats


@dataclass
class DirectRead:
    """Whole regions of ``peer`` into whole regions of the sink, by rows of the prepared lists."""

    peer: Peer
    remote_idx: np.ndarray
    local_idx: np.ndarray


@dataclass
class ReadPlan:
    direct: list[DirectRead]
    staged: list[StagedChunk]
    stats: TransferStats

    @property
    def empty(self) -> bool:
        return not self.direct and not self.staged

    def carries_notification(self, remote: Remote) -> bool:
        """True when the read is one READ from rank 0, which can carry the "done" notification itself."""
        return not self.staged and len(self.direct) == 1 and self.direct[0].peer is remote.peers[0]


def plan_read(handle: KvHandle, remote: Remote, sink: KvLayout, remote_block_ids: list[int],
              local_block_ids: list[int], staging: StagingBuffer, backend: str,
              slots: list[int] | None = None) -> ReadPlan:
    """See the module docstring."""
    if handle.compat_hash != remote.info.compat_hash:
        raise IncompatibleKvError("compat_hash", f"handle {handle.request_id} has another compat_hash "
                                                 f"than its source {handle.agent_name!r}")
    if len(remote_block_ids) != len(local_block_ids):
        raise ValueError(f"{len(remote_block_ids)} remote blocks but {len(local_block_ids)} local blocks")
    remote_blocks = np.asarray(remote_block_ids, dtype=np.int64)
    local_blocks = np.asarray(local_block_ids, dtype=np.int64)
    pair_slots = None if slots is None else np.asarray(slots, dtype=np.int64)
    if pair_slots is not None and (len(pair_slots) != len(local_blocks) or pair_slots.size
                                   and (pair_slots.min() < 1 or pair_slots.max() > sink.num_layers)):
        raise ValueError(f"slots must give 1..{sink.num_layers} layers for each of "
                         f"{len(local_blocks)} blocks")
    check_block_range("local", local_blocks, sink.num_blocks)
    direct: list[DirectRead] = []
    staged: list[StagedChunk] = []
    for peer in remote.peers:
        check_block_range("remote", remote_blocks, peer.info.layout.num_blocks)
        if peer.runs and len(local_blocks):
            if peer.staged and pair_slots is not None:
                raise ValueError("a hybrid model's KV groups move only between equal KV head ranges "
                                 "(equal tensor-parallel sizes); serve it with --no-hybrid-kv")
            if peer.staged:
                staged.extend(staging.chunks(peer, remote_blocks, local_blocks))
            else:
                direct.append(DirectRead(peer, *region_indices(sink, peer.info.layout, remote_blocks,
                                                               local_blocks, pair_slots)))
    regions = pair_layers(sink, len(local_blocks), pair_slots)
    stats = read_stats(sink, len(local_blocks), remote.peers, direct, staged, backend, regions)
    return ReadPlan(direct, staged, stats)


def read_stats(sink: KvLayout, blocks: int, peers: list[Peer], direct: list[DirectRead],
               staged: list[StagedChunk], backend: str, regions: int | None = None) -> TransferStats:
    """The read's counts (see the module docstring), ``seconds`` 0; ``regions``: the (layer, block)
    regions each direct read moves (every layer of each block when None)."""
    row_bytes = sink.parts * sink.block_size * sink.head_dim * sink.element_size  # one head of a block
    regions = blocks * sink.num_layers if regions is None else regions
    whole = len(direct) * regions * (sink.region_bytes + sink.scale_region_bytes)
    heads = sum(blocks * sink.num_layers * row_bytes * (run.stop - run.start)
                for peer in peers if peer.staged for run in peer.runs)
    return TransferStats(
        blocks=blocks,
        bytes=whole + heads,
        descriptors=(sum(merged_descriptor_count(d.local_idx, d.remote_idx) for d in direct)
                     + sum(len(chunk.local_table) for chunk in staged)),
        seconds=0.0,
        backend=backend,
        staged_bytes=sum(int(chunk.local_table[:, 1].sum()) for chunk in staged),
    )

"""The READs of one read in flight, and the two drivers that see them through.

- ``PendingRead.post(plan, local_dlist, carried)`` posts a ``ReadPlan`` (``transfer/read_plan.py``): one
  READ per whole-region source rank, by index into the prepared lists (the one READ of a read from
  rank 0 alone carries the "done" notification, ``carried``), and the first staged chunk.
- ``progress()`` checks each READ's state; once the staged READ in flight is DONE it copies that chunk's
  heads out of the staging buffer into the cache (``transfer/staging.py``: ``copy_heads``) and posts the
  next chunk, so the buffer holds one chunk at a time. It answers True once every READ is DONE and no
  chunk is left, raises ``TransferError("error")`` when NIXL reports a failed READ and the read's deadline
  outcome (``"timeout"`` or ``"expired"``) past its deadline (``time.perf_counter`` seconds).
- ``release()`` releases every transfer handle; the drivers call it however the read ends.
- Drivers: ``finish`` awaits between progresses (a backoff from ``MIN_POLL_S`` to ``MAX_POLL_S``, so the
  event loop runs meanwhile); ``finish_blocking`` sleeps ``MIN_POLL_S`` between them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

import msgspec
import torch

from transfer.errors import TransferError
from transfer.read_plan import ReadPlan
from transfer.staging import copy_heads
from transfer.staging_buffer import StagedChunk, StagingBuffer
from transfer.wire import KvLayout, TransferStats

if TYPE_CHECKING:
    from nixl._api import nixl_agent, nixl_prepped_dlist_handle, nixl_xfer_handle

logger = logging.getLogger(__name__)

MIN_POLL_S = 0.0002
MAX_POLL_S = 0.005


class PendingRead:
    """One read's READs, from posting to release; see the module docstring."""

    def __init__(self, agent: nixl_agent, request_id: str, within: float, deadline_outcome: str,
                 notify_after: bytes, cache: torch.Tensor, sink: KvLayout, staging: StagingBuffer,
                 mem_type: str) -> None:
        self.request_id = request_id
        self.started = time.perf_counter()
        self.deadline = self.started + within
        self.deadline_outcome = deadline_outcome
        self.notify_after = notify_after  # "done", to send once every READ completed (b"": none)
        self._agent = agent
        self._cache, self._sink, self._staging, self._mem_type = cache, sink, staging, mem_type
        self._xfers: list[nixl_xfer_handle] = []
        self._states: list[str] = []
        self._chunks: list[StagedChunk] = []  # staged READs still to post, in order
        self._staged: StagedChunk | None = None  # the staged READ in flight: the last of ``_xfers``

    def post(self, plan: ReadPlan, local_dlist: nixl_prepped_dlist_handle, carried: bytes) -> None:
        self._chunks = list(plan.staged)
        try:
            for read in plan.direct:
                self._add(self._agent.make_prepped_xfer("READ", local_dlist, read.local_idx, read.peer.dlist,
                                                        read.remote_idx, carried))
            self._post_chunk()
        except BaseException:
            self.release()
            raise

    def progress(self) -> bool:
        for i, xfer in enumerate(self._xfers):
            if self._states[i] == "PROC":
                self._states[i] = self._agent.check_xfer_state(xfer)
            if self._states[i] not in ("PROC", "DONE"):
                raise TransferError("error", f"NIXL READ for {self.request_id} failed ({self._states[i]})")
        chunk = self._staged
        if chunk is not None and self._states[-1] == "DONE":
            assert self._staging.tensor is not None
            copy_heads(self._cache, self._staging.tensor, chunk.peer.info.layout, self._sink, chunk.peer.runs,
                       chunk.local_blocks)
            self._staged = None
            self._post_chunk()
        if self._staged is None and all(state == "DONE" for state in self._states):
            return True
        if time.perf_counter() >= self.deadline:
            raise TransferError(self.deadline_outcome, f"READ for {self.request_id} passed its deadline")
        return False

    def release(self) -> None:
        for xfer in self._xfers:
            try:
                xfer.release()
            except Exception:  # noqa: BLE001 - NIXL could not cancel; the agent keeps it for cleanup
                logger.exception("releasing the READ of %s failed", self.request_id)

    def timed(self, stats: TransferStats) -> TransferStats:
        """``stats`` with the seconds from posting until now."""
        return msgspec.structs.replace(stats, seconds=time.perf_counter() - self.started)

    def _post_chunk(self) -> None:
        """Post the next staged READ, if any (the staging buffer is free: the last one was copied out)."""
        if not self._chunks:
            return
        chunk = self._chunks.pop(0)
        agent = self._agent
        self._add(agent.initialize_xfer("READ", agent.get_xfer_descs(chunk.local_table, self._mem_type),
                                        agent.get_xfer_descs(chunk.remote_table, chunk.peer.info.mem_type),
                                        chunk.peer.nixl_name, b""))
        self._staged = chunk

    def _add(self, xfer: nixl_xfer_handle) -> None:
        self._xfers.append(xfer)
        self._states.append(self._agent.transfer(xfer))


async def finish(read: PendingRead) -> None:
    """Progress ``read`` until done, awaiting between progresses; released however it ends."""
    delay = MIN_POLL_S
    try:
        while not read.progress():
            await asyncio.sleep(delay)
            delay = min(delay * 2, MAX_POLL_S)
    finally:
        read.release()


def finish_blocking(read: PendingRead) -> None:
    """Progress ``read`` until done, sleeping between progresses; released however it ends."""
    try:
        while not read.progress():
            time.sleep(MIN_POLL_S)
    finally:
        read.release()

"""The decode side of a KV transfer: pull a request's blocks from a source with NIXL READ.

Contract
--------
- The sink registers the decode worker's whole KV cache tensor once and prepares a
  local descriptor list of all its ``num_layers * num_blocks`` regions once.
- ``read_threads`` (default ``default_read_threads``: 2 on a multi-core host for host
  memory, ``PDSERVE_KV_READ_THREADS`` overrides) UCX worker threads share each READ
  of at least that many descriptors; see ``transfer/agent.py``.
- ``connect(info)`` is the handshake, once per source agent: wire version and
  compatibility hash are checked first (``IncompatibleKvError`` names the field
  that differs), then the remote agent is added and a remote descriptor list of all
  the source's regions (with the source's own ``num_blocks``) is prepared once.
  Calling it again with the same info is a no-op; with new info for the same name
  (a restarted source) it reconnects.
- ``read(handle, remote_block_ids, local_block_ids, timeout)`` copies every layer of
  each ``remote_block_ids[i]`` into ``local_block_ids[i]``, as one READ built by
  index from the prepared lists (NIXL merges runs of address-contiguous regions;
  ``TransferStats.descriptors`` counts the merged descriptors). The decode worker
  owns and reserves the local blocks beforehand; the sink never frees anything.
- Notification protocol: the READ carries ``done:<request_id>``, which NIXL delivers
  to the source only once the READ completed; the source then ends the lease and
  prefill frees the blocks. An empty read sends ``done:`` on its own. When decode
  gives up on a handle without a successful read (abort, failure, retry elsewhere)
  it must call ``release(handle)``, which sends ``release:<request_id>``; a failed
  ``read`` does not release by itself, so the caller may retry the same handle.
- Deadlines: a read never waits past ``min(now + timeout, handle.lease_deadline)``;
  ``TransferError.outcome`` is ``"timeout"`` or ``"expired"`` accordingly (a handle
  whose lease already ended is refused before posting). NIXL ``ERR`` raises
  ``"error"``. The transfer handle is released on every path.
- Fault injection (tests and chaos runs only; off by default): ``inject_failures(n)``
  fails the next ``n`` reads, ``inject_failure_rate(rate, seed)`` fails each read with
  probability ``rate`` from a ``random.Random(seed)`` (the same seed fails the same
  reads). An injected failure raises ``TransferError("injected")`` before anything is
  posted, exactly where a refused READ would.
- Single-threaded: call every method from one thread (the worker's event loop).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from dataclasses import dataclass

import numpy as np
import torch
from nixl._api import nixl_agent, nixl_prepped_dlist_handle, nixl_xfer_handle

from transfer.agent import ProgressPump, default_read_threads, new_agent
from transfer.compat import check_compatible, compat_hash
from transfer.errors import IncompatibleKvError, TransferError
from transfer.nixl_source import DONE_PREFIX, RELEASE_PREFIX, check_tensor, region_table, tensor_placement
from transfer.wire import AgentInfo, KvHandle, KvLayout, TransferStats

logger = logging.getLogger(__name__)

MIN_POLL_S = 0.0002
MAX_POLL_S = 0.005
PROGRESS_INTERVAL_S = 0.005


@dataclass
class _Remote:
    info: AgentInfo
    nixl_name: str
    dlist: nixl_prepped_dlist_handle


@dataclass
class _Pending:
    xfer: nixl_xfer_handle
    request_id: str
    started: float
    deadline: float
    deadline_outcome: str
    state: str


class KvSink:
    """Reads KV blocks from connected sources into this worker's KV cache."""

    def __init__(
        self,
        kv_cache: torch.Tensor,
        layout: KvLayout,
        agent_name: str,
        backend: str = "UCX",
        *,
        progress_thread: bool = False,
        scales: torch.Tensor | None = None,
        read_threads: int | None = None,
    ) -> None:
        check_tensor(kv_cache, layout, scales)
        self.layout = layout
        self.agent_name = agent_name
        self.backend = backend
        self._hash = compat_hash(layout)
        self._kv_cache = kv_cache
        self._scales = scales
        mem_type, device_id = tensor_placement(kv_cache)
        if read_threads is None:
            read_threads = default_read_threads(mem_type)
        if read_threads < 0:
            raise ValueError(f"read_threads must be >= 0, got {read_threads}")
        self.read_threads = read_threads
        self._agent: nixl_agent | None = new_agent(agent_name, backend, progress_thread, read_threads)
        tensors = kv_cache if scales is None else [kv_cache, scales]
        self._reg = self._agent.register_memory(tensors, backends=[backend])
        # Completes notification sends between reads; the sink expects no notifications.
        self._pump = ProgressPump(self._agent, agent_name, PROGRESS_INTERVAL_S, keep_notifs=False)
        table = region_table(kv_cache.data_ptr(), layout, device_id,
                             scales.data_ptr() if scales is not None else 0)
        self._local = self._agent.prep_xfer_dlist("NIXL_INIT_AGENT", table, mem_type, backends=[backend])
        self._remotes: dict[str, _Remote] = {}
        self._failures_to_inject = 0
        self._failure_rate = 0.0
        self._failure_rng = random.Random(0)

    def connect(self, info: AgentInfo) -> None:
        known = self._remotes.get(info.agent_name)
        if known is not None and known.info == info:
            return
        check_compatible(self.layout, info)
        if known is not None:
            self._disconnect(known)
        agent = self._live_agent()
        nixl_name = agent.add_remote_agent(info.metadata)
        if isinstance(nixl_name, bytes):
            nixl_name = nixl_name.decode()
        table = region_table(info.base_addr, info.layout, info.device_id, info.scales_addr)
        dlist = agent.prep_xfer_dlist(nixl_name, table, info.mem_type, backends=[self.backend])
        agent.make_connection(nixl_name, backends=[self.backend])
        self._remotes[info.agent_name] = _Remote(info, nixl_name, dlist)

    def disconnect(self, agent_name: str) -> None:
        """Forget a source that left (its worker drained); unknown names are ignored."""
        known = self._remotes.get(agent_name)
        if known is not None:
            self._disconnect(known)

    def inject_failures(self, n: int) -> None:
        self._failures_to_inject = n

    def inject_failure_rate(self, rate: float, seed: int = 0) -> None:
        """Fail each later read with probability ``rate`` (0 turns it off), drawn from ``Random(seed)``."""
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"failure rate must be within [0, 1], got {rate}")
        self._failure_rate = rate
        self._failure_rng = random.Random(seed)

    async def read(
        self, handle: KvHandle, remote_block_ids: list[int], local_block_ids: list[int], timeout: float
    ) -> TransferStats:
        pending, stats = self._post(handle, remote_block_ids, local_block_ids, timeout)
        if pending is None:
            return stats
        delay = MIN_POLL_S
        try:
            while not self._progress(pending):
                await asyncio.sleep(delay)
                delay = min(delay * 2, MAX_POLL_S)
        finally:
            self._release_xfer(pending)
        return _finished(stats, pending)

    def read_blocking(
        self, handle: KvHandle, remote_block_ids: list[int], local_block_ids: list[int], timeout: float
    ) -> TransferStats:
        pending, stats = self._post(handle, remote_block_ids, local_block_ids, timeout)
        if pending is None:
            return stats
        try:
            while not self._progress(pending):
                time.sleep(MIN_POLL_S)
        finally:
            self._release_xfer(pending)
        return _finished(stats, pending)

    def release(self, handle: KvHandle) -> None:
        remote = self._remotes.get(handle.agent_name)
        if remote is None:
            logger.warning("release of %s: source %r never connected", handle.request_id, handle.agent_name)
            return
        self._live_agent().send_notif(remote.nixl_name, (RELEASE_PREFIX + handle.request_id).encode())

    def close(self) -> None:
        """Drop every remote, the descriptor lists and the registration (idempotent)."""
        if self._agent is None:
            return
        self._pump.stop()
        for remote in list(self._remotes.values()):
            self._disconnect(remote)
        try:
            self._local.release()
            self._agent.deregister_memory(self._reg, backends=[self.backend])
        except Exception:  # noqa: BLE001 - best effort on shutdown
            logger.exception("closing KV sink %s failed", self.agent_name)
        self._agent = None

    def _post(
        self, handle: KvHandle, remote_block_ids: list[int], local_block_ids: list[int], timeout: float
    ) -> tuple[_Pending | None, TransferStats]:
        """Validate, then post one READ; ``None`` when there was nothing to move."""
        if self._failures_to_inject > 0:
            self._failures_to_inject -= 1
            raise TransferError("injected", f"injected failure reading {handle.request_id}")
        if self._failure_rate > 0.0 and self._failure_rng.random() < self._failure_rate:
            raise TransferError("injected", f"injected failure (rate {self._failure_rate:g}) reading "
                                            f"{handle.request_id}")
        remote = self._remotes.get(handle.agent_name)
        if remote is None:
            raise TransferError("unknown_agent", f"source {handle.agent_name!r} is not connected")
        if handle.compat_hash != self._hash:
            raise IncompatibleKvError("compat_hash", f"handle {handle.request_id} has another compat_hash")
        remote_idx, local_idx = self._indices(remote, remote_block_ids, local_block_ids)
        now = time.time()
        if handle.lease_deadline <= now:
            raise TransferError("expired", f"lease of {handle.request_id} ended before the read")
        agent = self._live_agent()
        notif = (DONE_PREFIX + handle.request_id).encode()
        started = time.perf_counter()
        stats = TransferStats(
            blocks=len(local_block_ids),
            bytes=len(local_block_ids) * self.layout.num_layers
            * (self.layout.region_bytes + self.layout.scale_region_bytes),
            descriptors=merged_descriptor_count(local_idx, remote_idx),
            seconds=0.0,
            backend=self.backend,
        )
        if len(local_idx) == 0:
            agent.send_notif(remote.nixl_name, notif)
            return None, stats
        xfer = agent.make_prepped_xfer("READ", self._local, local_idx, remote.dlist, remote_idx, notif)
        outcome = "timeout" if now + timeout <= handle.lease_deadline else "expired"
        deadline = started + min(timeout, handle.lease_deadline - now)
        pending = _Pending(xfer, handle.request_id, started, deadline, outcome, "PROC")
        try:
            pending.state = agent.transfer(xfer)
        except BaseException:
            self._release_xfer(pending)
            raise
        return pending, stats

    def _progress(self, pending: _Pending) -> bool:
        """True once the READ is done; raises on error or past the deadline."""
        if pending.state == "PROC":
            pending.state = self._live_agent().check_xfer_state(pending.xfer)
        if pending.state == "DONE":
            return True
        if pending.state != "PROC":
            raise TransferError("error", f"NIXL READ for {pending.request_id} failed ({pending.state})")
        if time.perf_counter() >= pending.deadline:
            raise TransferError(
                pending.deadline_outcome, f"READ for {pending.request_id} passed its deadline"
            )
        return False

    def _indices(
        self, remote: _Remote, remote_block_ids: list[int], local_block_ids: list[int]
    ) -> tuple[np.ndarray, np.ndarray]:
        if len(remote_block_ids) != len(local_block_ids):
            raise ValueError(f"{len(remote_block_ids)} remote blocks but {len(local_block_ids)} local blocks")
        remote_blocks = np.asarray(remote_block_ids, dtype=np.int64)
        local_blocks = np.asarray(local_block_ids, dtype=np.int64)
        _check_range("remote", remote_blocks, remote.info.layout.num_blocks)
        _check_range("local", local_blocks, self.layout.num_blocks)
        layers = np.arange(self.layout.num_layers, dtype=np.int64)[:, None]
        remote_idx = (layers * remote.info.layout.num_blocks + remote_blocks[None, :]).ravel()
        local_idx = (layers * self.layout.num_blocks + local_blocks[None, :]).ravel()
        if self.layout.scale_region_bytes:  # the scale regions follow the K/V regions in both tables
            remote_count = self.layout.num_layers * remote.info.layout.num_blocks
            local_count = self.layout.num_layers * self.layout.num_blocks
            remote_idx = np.concatenate((remote_idx, remote_idx + remote_count))
            local_idx = np.concatenate((local_idx, local_idx + local_count))
        return remote_idx.astype(np.int32), local_idx.astype(np.int32)

    def _release_xfer(self, pending: _Pending) -> None:
        try:
            pending.xfer.release()
        except Exception:  # noqa: BLE001 - NIXL could not cancel; the agent keeps it for cleanup
            logger.exception("releasing the READ of %s failed", pending.request_id)

    def _disconnect(self, remote: _Remote) -> None:
        self._remotes.pop(remote.info.agent_name, None)
        try:
            remote.dlist.release()
            self._live_agent().remove_remote_agent(remote.nixl_name)
        except Exception:  # noqa: BLE001 - the remote may already be gone
            logger.exception("disconnecting from %s failed", remote.info.agent_name)

    def _live_agent(self) -> nixl_agent:
        if self._agent is None:
            raise RuntimeError(f"KV sink {self.agent_name} is closed")
        return self._agent


def merged_descriptor_count(local_idx: np.ndarray, remote_idx: np.ndarray) -> int:
    """Descriptors after merging runs that are contiguous on both sides (as NIXL does)."""
    if len(local_idx) == 0:
        return 0
    contiguous = (np.diff(local_idx) == 1) & (np.diff(remote_idx) == 1)
    return int(len(local_idx) - np.count_nonzero(contiguous))


def _check_range(side: str, blocks: np.ndarray, num_blocks: int) -> None:
    if blocks.size and (blocks.min() < 0 or blocks.max() >= num_blocks):
        raise ValueError(f"{side} block id out of range [0, {num_blocks}): {blocks.tolist()}")


def _finished(stats: TransferStats, pending: _Pending) -> TransferStats:
    seconds = time.perf_counter() - pending.started
    return TransferStats(stats.blocks, stats.bytes, stats.descriptors, seconds, stats.backend)

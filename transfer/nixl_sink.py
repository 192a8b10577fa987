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
- Tensor parallelism (``transfer/heads.py``): the sink is one rank's shard, the source
  ``info`` a whole worker (rank 0's agent, the others in ``tp_ranks``). ``connect``
  adds the source ranks that hold this rank's KV heads (and rank 0, which the
  notifications go to) and checks every head is held (``IncompatibleKvError`` at the
  handshake, naming the TP sizes, otherwise). ``read`` posts one READ per source
  rank whose heads equal this rank's (whole regions: the prepared lists, as below).
  From a source rank holding other heads it stages (``transfer/staging.py``): READs
  that rank's whole regions into one staging buffer (``staging_bytes``, default
  ``DEFAULT_STAGING_BYTES`` = 32 MiB, registered with NIXL at the first connect that
  needs it), in chunks of as many blocks as fit, one chunk at a time, and copies each
  chunk's needed heads into the cache before the next chunk's READ. Descriptors: one
  per (layer, run of consecutive blocks) and chunk. ``TransferStats.bytes`` counts the
  KV bytes placed in the cache, ``staged_bytes`` what the staged READs moved (more
  when the source rank holds heads this rank does not need). Async reads that stage
  take turns on the buffer (the wait bounded by the read's deadline).
- ``read(handle, remote_block_ids, local_block_ids, timeout)`` copies every layer of
  each ``remote_block_ids[i]`` into ``local_block_ids[i]``, as one READ built by
  index from the prepared lists (NIXL merges runs of address-contiguous regions;
  ``TransferStats.descriptors`` counts the merged descriptors). The decode worker
  owns and reserves the local blocks beforehand; the sink never frees anything.
- Notification protocol: the READ carries ``done:<request_id>``, which NIXL delivers
  to the source only once the READ completed (with several READs, or ``notify=False``
  and a later ``notify_done``, the sink sends it itself once they all completed:
  a tensor-parallel decode worker's rank 0 sends it after every rank's READs); the
  source then ends the lease and prefill frees the blocks. An empty read sends
  ``done:`` on its own. When decode gives up on a handle without a successful read
  (abort, failure, retry elsewhere) it must call ``release(handle)``, which sends
  ``release:<request_id>``; a failed ``read`` does not release by itself, so the
  caller may retry the same handle.
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
from typing import Any

import msgspec
import numpy as np
import torch
from nixl._api import nixl_agent, nixl_prepped_dlist_handle, nixl_xfer_handle

from transfer.agent import ProgressPump, default_read_threads, new_agent
from transfer.compat import check_compatible
from transfer.errors import IncompatibleKvError, TransferError
from transfer.heads import HeadRun, head_reads, whole_rows
from transfer.nixl_source import DONE_PREFIX, RELEASE_PREFIX, check_tensor, region_table, tensor_placement
from transfer.staging import DEFAULT_STAGING_BYTES, blocks_per_chunk, chunks, copy_heads, read_tables
from transfer.wire import AgentInfo, KvHandle, KvLayout, TransferStats

logger = logging.getLogger(__name__)

MIN_POLL_S = 0.0002
MAX_POLL_S = 0.005
PROGRESS_INTERVAL_S = 0.005


@dataclass
class _Peer:
    """One rank of a source worker: its NIXL name, its whole-region list, the heads read from it."""

    info: AgentInfo
    nixl_name: str
    dlist: nixl_prepped_dlist_handle | None  # whole regions into whole regions; None: staged (or unread)
    runs: list[HeadRun]

    @property
    def staged(self) -> bool:
        return bool(self.runs) and self.dlist is None


@dataclass
class _Chunk:
    """One staged READ: every layer of ``remote_blocks`` of ``peer`` into staging, then ``local_blocks``."""

    peer: _Peer
    remote_blocks: np.ndarray
    local_blocks: np.ndarray
    local_table: np.ndarray
    remote_table: np.ndarray


@dataclass
class _Remote:
    info: AgentInfo  # the source worker's rank 0 (its other ranks in ``tp_ranks``)
    peers: list[_Peer]  # peers[0] is rank 0: notifications go there

    @property
    def nixl_name(self) -> str:
        return self.peers[0].nixl_name


@dataclass
class _Pending:
    xfers: list[nixl_xfer_handle]
    request_id: str
    started: float
    deadline: float
    deadline_outcome: str
    states: list[str]
    notify_after: bytes  # a "done" notification to send once every READ completed (b"": none)
    chunks: list[_Chunk]  # staged READs still to post, in order
    staged: _Chunk | None = None  # the staged READ in flight: the last of ``xfers``


class KvSink:
    """Reads KV blocks from connected sources into this worker's KV cache (or this rank's shard)."""

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
        staging_bytes: int = DEFAULT_STAGING_BYTES,
    ) -> None:
        check_tensor(kv_cache, layout, scales)
        self.layout = layout
        self.agent_name = agent_name
        self.backend = backend
        self._kv_cache = kv_cache
        self._scales = scales
        mem_type, device_id = tensor_placement(kv_cache)
        self._mem_type, self._device_id = mem_type, device_id
        if read_threads is None:
            read_threads = default_read_threads(mem_type)
        if read_threads < 0:
            raise ValueError(f"read_threads must be >= 0, got {read_threads}")
        self.read_threads = read_threads
        self._agent: nixl_agent | None = new_agent(agent_name, backend, progress_thread, read_threads)
        tensors = kv_cache if scales is None else [kv_cache, scales]
        self._reg = self._agent.register_memory(tensors, backends=[backend])
        # Completes notification sends (kicked by each READ and send); the sink expects no notifications.
        self._pump = ProgressPump(self._agent, agent_name, PROGRESS_INTERVAL_S, keep_notifs=False)
        table = region_table(kv_cache.data_ptr(), layout, device_id,
                             scales.data_ptr() if scales is not None else 0)
        self._local = self._agent.prep_xfer_dlist("NIXL_INIT_AGENT", table, mem_type, backends=[backend])
        self._remotes: dict[str, _Remote] = {}
        if staging_bytes <= 0:
            raise ValueError(f"staging_bytes must be > 0, got {staging_bytes}")
        self.staging_bytes = staging_bytes
        self._staging: torch.Tensor | None = None  # allocated and registered at the first staged connect
        self._staging_reg: Any = None
        self._staging_busy = False  # an async read is using the staging buffer
        self._failures_to_inject = 0
        self._failure_rate = 0.0
        self._failure_rng = random.Random(0)

    def connect(self, info: AgentInfo) -> None:
        known = self._remotes.get(info.agent_name)
        if known is not None and known.info == info:
            return
        group = info.group
        for rank in group:
            check_compatible(self.layout, rank)
        runs = head_reads(self.layout, [rank.layout for rank in group])
        if known is not None:
            self._disconnect(known)
        agent = self._live_agent()
        peers: list[_Peer] = []
        for index, rank in enumerate(group):
            mine = [run for run in runs if run.source == index]
            if not mine and index > 0:
                continue
            nixl_name = agent.add_remote_agent(rank.metadata)
            if isinstance(nixl_name, bytes):
                nixl_name = nixl_name.decode()
            dlist = None
            if len(mine) == 1 and whole_rows(mine[0], self.layout, rank.layout):
                table = region_table(rank.base_addr, rank.layout, rank.device_id, rank.scales_addr)
                dlist = agent.prep_xfer_dlist(nixl_name, table, rank.mem_type, backends=[self.backend])
            elif mine:
                blocks_per_chunk(rank.layout, self.staging_bytes)  # a buffer too small fails here
                self._register_staging()
            agent.make_connection(nixl_name, backends=[self.backend])
            peers.append(_Peer(rank, nixl_name, dlist, mine))
        self._remotes[info.agent_name] = _Remote(info, peers)

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
        self, handle: KvHandle, remote_block_ids: list[int], local_block_ids: list[int], timeout: float,
        notify: bool = True,
    ) -> TransferStats:
        remote = self._remotes.get(handle.agent_name)
        if remote is None or not any(peer.staged for peer in remote.peers):
            return await self._read(handle, remote_block_ids, local_block_ids, timeout, notify)
        started = time.monotonic()
        delay = MIN_POLL_S
        while self._staging_busy:  # another read stages: wait for it, within this read's deadline
            if time.monotonic() - started >= timeout or time.time() >= handle.lease_deadline:
                outcome = "timeout" if time.time() < handle.lease_deadline else "expired"
                raise TransferError(outcome, f"the staging buffer stayed busy past the deadline of "
                                             f"{handle.request_id}")
            await asyncio.sleep(delay)
            delay = min(delay * 2, MAX_POLL_S)
        self._staging_busy = True
        try:
            left = max(0.0, timeout - (time.monotonic() - started))
            return await self._read(handle, remote_block_ids, local_block_ids, left, notify)
        finally:
            self._staging_busy = False

    async def _read(
        self, handle: KvHandle, remote_block_ids: list[int], local_block_ids: list[int], timeout: float,
        notify: bool,
    ) -> TransferStats:
        pending, stats = self._post(handle, remote_block_ids, local_block_ids, timeout, notify)
        if pending is None:
            return stats
        delay = MIN_POLL_S
        try:
            while not self._progress(pending):
                await asyncio.sleep(delay)
                delay = min(delay * 2, MAX_POLL_S)
        finally:
            self._release_xfer(pending)
        self._notify_after(handle, pending)
        return _finished(stats, pending)

    def read_blocking(
        self, handle: KvHandle, remote_block_ids: list[int], local_block_ids: list[int], timeout: float,
        notify: bool = True,
    ) -> TransferStats:
        if self._staging_busy:
            raise RuntimeError(f"KV sink {self.agent_name}: a blocking read while an async read stages "
                               f"(call every method from one thread)")
        pending, stats = self._post(handle, remote_block_ids, local_block_ids, timeout, notify)
        if pending is None:
            return stats
        try:
            while not self._progress(pending):
                time.sleep(MIN_POLL_S)
        finally:
            self._release_xfer(pending)
        self._notify_after(handle, pending)
        return _finished(stats, pending)

    def notify_done(self, handle: KvHandle) -> None:
        """Tell the source its blocks were read (after reads with ``notify=False`` completed)."""
        self._send(self._remote(handle).nixl_name, (DONE_PREFIX + handle.request_id).encode())

    def release(self, handle: KvHandle) -> None:
        remote = self._remotes.get(handle.agent_name)
        if remote is None:
            logger.warning("release of %s: source %r never connected", handle.request_id, handle.agent_name)
            return
        self._send(remote.nixl_name, (RELEASE_PREFIX + handle.request_id).encode())

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
            if self._staging_reg is not None:
                self._agent.deregister_memory(self._staging_reg, backends=[self.backend])
        except Exception:  # noqa: BLE001 - best effort on shutdown
            logger.exception("closing KV sink %s failed", self.agent_name)
        self._agent = None

    def _remote(self, handle: KvHandle) -> _Remote:
        remote = self._remotes.get(handle.agent_name)
        if remote is None:
            raise TransferError("unknown_agent", f"source {handle.agent_name!r} is not connected")
        return remote

    def _post(
        self, handle: KvHandle, remote_block_ids: list[int], local_block_ids: list[int], timeout: float,
        notify: bool,
    ) -> tuple[_Pending | None, TransferStats]:
        """Validate, then post the READs (one per source rank); ``None`` when there was nothing to move."""
        if self._failures_to_inject > 0:
            self._failures_to_inject -= 1
            raise TransferError("injected", f"injected failure reading {handle.request_id}")
        if self._failure_rate > 0.0 and self._failure_rng.random() < self._failure_rate:
            raise TransferError("injected", f"injected failure (rate {self._failure_rate:g}) reading "
                                            f"{handle.request_id}")
        remote = self._remote(handle)
        if handle.compat_hash != remote.info.compat_hash:
            raise IncompatibleKvError("compat_hash", f"handle {handle.request_id} has another compat_hash "
                                                     f"than its source {handle.agent_name!r}")
        if len(remote_block_ids) != len(local_block_ids):
            raise ValueError(f"{len(remote_block_ids)} remote blocks but {len(local_block_ids)} local blocks")
        remote_blocks = np.asarray(remote_block_ids, dtype=np.int64)
        local_blocks = np.asarray(local_block_ids, dtype=np.int64)
        _check_range("local", local_blocks, self.layout.num_blocks)
        direct, staged = [], []
        for peer in remote.peers:
            _check_range("remote", remote_blocks, peer.info.layout.num_blocks)
            if peer.runs and len(local_blocks):
                if peer.staged:
                    staged.extend(self._chunks(peer, remote_blocks, local_blocks))
                else:
                    direct.append((peer, *self._indices(peer.info.layout, remote_blocks, local_blocks)))
        now = time.time()
        if handle.lease_deadline <= now:
            raise TransferError("expired", f"lease of {handle.request_id} ended before the read")
        agent = self._live_agent()
        notif = (DONE_PREFIX + handle.request_id).encode() if notify else b""
        started = time.perf_counter()
        dst, blocks = self.layout, len(local_block_ids)
        row_bytes = 2 * dst.block_size * dst.head_dim * dst.element_size  # one head of a block, K and V
        stats = TransferStats(
            blocks=blocks,
            bytes=(len(direct) * blocks * dst.num_layers * (dst.region_bytes + dst.scale_region_bytes)
                   + sum(blocks * dst.num_layers * row_bytes * (run.stop - run.start)
                         for peer in remote.peers if peer.staged for run in peer.runs)),
            descriptors=(sum(merged_descriptor_count(local_idx, remote_idx)
                             for _, remote_idx, local_idx in direct)
                         + sum(len(chunk.local_table) for chunk in staged)),
            seconds=0.0,
            backend=self.backend,
            staged_bytes=sum(int(chunk.local_table[:, 1].sum()) for chunk in staged),
        )
        if not direct and not staged:
            if notify:
                self._send(remote.nixl_name, notif)
            return None, stats
        # one READ to rank 0 carries the notification itself; otherwise it follows every READ
        carried = notif if not staged and len(direct) == 1 and direct[0][0] is remote.peers[0] else b""
        outcome = "timeout" if now + timeout <= handle.lease_deadline else "expired"
        deadline = started + min(timeout, handle.lease_deadline - now)
        pending = _Pending([], handle.request_id, started, deadline, outcome, [],
                           b"" if carried else notif, staged)
        try:
            for peer, remote_idx, local_idx in direct:
                xfer = agent.make_prepped_xfer("READ", self._local, local_idx, peer.dlist, remote_idx,
                                               carried)
                pending.xfers.append(xfer)
                pending.states.append(agent.transfer(xfer))
            self._post_chunk(pending)
        except BaseException:
            self._release_xfer(pending)
            raise
        self._pump.kick()  # the READs' notification goes out only while this agent progresses
        return pending, stats

    def _chunks(self, peer: _Peer, remote_blocks: np.ndarray, local_blocks: np.ndarray) -> list[_Chunk]:
        """The staged READs of ``peer``'s whole regions of the blocks, as many blocks as fit each."""
        assert self._staging is not None  # registered by connect
        src, staging = peer.info.layout, self._staging
        made = []
        for part in chunks(len(local_blocks), blocks_per_chunk(src, self.staging_bytes)):
            local_table, remote_table = read_tables(staging.data_ptr(), self._device_id, src,
                                                    peer.info.base_addr, peer.info.device_id,
                                                    remote_blocks[part])
            made.append(_Chunk(peer, remote_blocks[part], local_blocks[part], local_table, remote_table))
        return made

    def _post_chunk(self, pending: _Pending) -> None:
        """Post the next staged READ, if any (the staging buffer is free: the last one was copied out)."""
        if not pending.chunks:
            return
        agent = self._live_agent()
        chunk = pending.chunks.pop(0)
        xfer = agent.initialize_xfer("READ", agent.get_xfer_descs(chunk.local_table, self._mem_type),
                                     agent.get_xfer_descs(chunk.remote_table, chunk.peer.info.mem_type),
                                     chunk.peer.nixl_name, b"")
        pending.xfers.append(xfer)
        pending.states.append(agent.transfer(xfer))
        pending.staged = chunk

    def _progress(self, pending: _Pending) -> bool:
        """True once every READ is done; raises on error or past the deadline."""
        agent = self._live_agent()
        for i, xfer in enumerate(pending.xfers):
            if pending.states[i] == "PROC":
                pending.states[i] = agent.check_xfer_state(xfer)
            if pending.states[i] not in ("PROC", "DONE"):
                state = pending.states[i]
                raise TransferError("error", f"NIXL READ for {pending.request_id} failed ({state})")
        chunk = pending.staged
        if chunk is not None and pending.states[-1] == "DONE":
            assert self._staging is not None
            copy_heads(self._kv_cache, self._staging, chunk.peer.info.layout, self.layout, chunk.peer.runs,
                       chunk.local_blocks)
            pending.staged = None
            self._post_chunk(pending)
        if pending.staged is None and all(state == "DONE" for state in pending.states):
            return True
        if time.perf_counter() >= pending.deadline:
            raise TransferError(
                pending.deadline_outcome, f"READ for {pending.request_id} passed its deadline"
            )
        return False

    def _notify_after(self, handle: KvHandle, pending: _Pending) -> None:
        if pending.notify_after:
            self._send(self._remote(handle).nixl_name, pending.notify_after)
        else:
            self._pump.kick()  # the notification a READ carried completes only while we progress

    def _send(self, nixl_name: str, notif: bytes) -> None:
        """Send a notification and progress at the fast cadence until it has gone out."""
        self._live_agent().send_notif(nixl_name, notif)
        self._pump.kick()

    def _indices(
        self, src: KvLayout, remote_blocks: np.ndarray, local_blocks: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        layers = np.arange(self.layout.num_layers, dtype=np.int64)[:, None]
        remote_idx = (layers * src.num_blocks + remote_blocks[None, :]).ravel()
        local_idx = (layers * self.layout.num_blocks + local_blocks[None, :]).ravel()
        if self.layout.scale_region_bytes:  # the scale regions follow the K/V regions in both tables
            remote_count = self.layout.num_layers * src.num_blocks
            local_count = self.layout.num_layers * self.layout.num_blocks
            remote_idx = np.concatenate((remote_idx, remote_idx + remote_count))
            local_idx = np.concatenate((local_idx, local_idx + local_count))
        return remote_idx.astype(np.int32), local_idx.astype(np.int32)

    def _release_xfer(self, pending: _Pending) -> None:
        for xfer in pending.xfers:
            try:
                xfer.release()
            except Exception:  # noqa: BLE001 - NIXL could not cancel; the agent keeps it for cleanup
                logger.exception("releasing the READ of %s failed", pending.request_id)

    def _disconnect(self, remote: _Remote) -> None:
        self._remotes.pop(remote.info.agent_name, None)
        for peer in remote.peers:
            try:
                if peer.dlist is not None:
                    peer.dlist.release()
                self._live_agent().remove_remote_agent(peer.nixl_name)
            except Exception:  # noqa: BLE001 - the remote may already be gone
                logger.exception("disconnecting from %s failed", peer.info.agent_name)

    def _register_staging(self) -> None:
        if self._staging is None:
            self._staging = torch.empty(self.staging_bytes, dtype=torch.uint8, device=self._kv_cache.device)
            self._staging_reg = self._live_agent().register_memory(self._staging, backends=[self.backend])

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
    return msgspec.structs.replace(stats, seconds=seconds)

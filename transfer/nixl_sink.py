"""The decode side of a KV transfer: pull a request's blocks from a source with NIXL READ.

Contract
--------
- The sink registers the decode worker's whole KV cache tensor once and prepares a
  local descriptor list of all its ``num_layers * num_blocks`` regions once.
- ``read_threads`` (default ``default_read_threads``: 2 on a multi-core host for host
  memory, ``PDSERVE_KV_READ_THREADS`` overrides) UCX worker threads share each READ
  of at least that many descriptors; see ``transfer/agent.py``.
- ``connect(info)`` is the handshake, once per source agent (``transfer/sink_handshake.py``):
  every rank of the source is checked first (``IncompatibleKvError`` names the field
  that differs, or the TP sizes when this rank's KV heads are not all held), then the
  remote agents are added and a remote descriptor list of all the regions of each rank
  whose heads equal this rank's is prepared once. Calling it again with the same info is
  a no-op; with new info for the same name (a restarted source) it reconnects.
- Tensor parallelism (``transfer/heads.py``): the sink is one rank's shard, the source
  ``info`` a whole worker (rank 0's agent, the others in ``tp_ranks``). ``read`` posts
  one READ per source rank whose heads equal this rank's (whole regions, by index into
  the prepared lists: ``transfer/descriptors.py``). From a source rank holding other
  heads it stages (``transfer/staging.py``, ``transfer/staging_buffer.py``): READs that
  rank's whole regions into one staging buffer (``staging_bytes``, default
  ``DEFAULT_STAGING_BYTES`` = 32 MiB, registered with NIXL at the first connect that
  needs it), in chunks of as many blocks as fit, one chunk at a time, and copies each
  chunk's needed heads into the cache before the next chunk's READ
  (``transfer/pending_read.py``). Async reads that stage take turns on the buffer (the
  wait bounded by the read's deadline).
- ``read(handle, remote_block_ids, local_block_ids, timeout, slots=None)`` copies every layer
  (with ``slots``, a hybrid model's KV group's first ``slots[i]``) of each ``remote_block_ids[i]``
  into ``local_block_ids[i]``; what it moves and counts
  (``TransferStats``) is worked out before anything is posted (``transfer/read_plan.py``).
  The decode worker owns and reserves the local blocks beforehand; the sink never frees
  anything. ``read_blocking`` is the same read for a caller without an event loop.
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
- Fault injection (tests and chaos runs only; off by default; ``transfer/faults.py``):
  ``inject_failures(n)`` fails the next ``n`` reads, ``inject_failure_rate(rate, seed)``
  fails each read with probability ``rate`` from a ``random.Random(seed)`` (the same seed
  fails the same reads). An injected failure raises ``TransferError("injected")`` before
  anything is posted, exactly where a refused READ would.
- Single-threaded: call every method from one thread (the worker's event loop).
"""

from __future__ import annotations

import logging
import time

import torch
from nixl._api import nixl_agent

from transfer.agent import ProgressPump, default_read_threads, new_agent
from transfer.descriptors import region_table
from transfer.errors import TransferError
from transfer.faults import FaultInjector
from transfer.nixl_source import DONE_PREFIX, RELEASE_PREFIX, check_tensor, tensor_placement
from transfer.pending_read import PendingRead, finish, finish_blocking
from transfer.read_plan import plan_read
from transfer.sink_handshake import Remote, connect_peers, disconnect_peers, plan_peers
from transfer.staging import DEFAULT_STAGING_BYTES
from transfer.staging_buffer import StagingBuffer
from transfer.wire import AgentInfo, KvHandle, KvLayout, TransferStats

logger = logging.getLogger(__name__)

PROGRESS_INTERVAL_S = 0.005


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
        self._mem_type = mem_type
        if read_threads is None:
            read_threads = default_read_threads(mem_type)
        if read_threads < 0:
            raise ValueError(f"read_threads must be >= 0, got {read_threads}")
        self.read_threads = read_threads
        self._staging = StagingBuffer(staging_bytes, kv_cache.device, device_id, backend)
        self.staging_bytes = staging_bytes
        self._agent: nixl_agent | None = new_agent(agent_name, backend, progress_thread, read_threads)
        tensors = kv_cache if scales is None else [kv_cache, scales]
        self._reg = self._agent.register_memory(tensors, backends=[backend])
        # Completes notification sends (kicked by each READ and send); the sink expects no notifications.
        self._pump = ProgressPump(self._agent, agent_name, PROGRESS_INTERVAL_S, keep_notifs=False)
        table = region_table(kv_cache.data_ptr(), layout, device_id,
                             scales.data_ptr() if scales is not None else 0)
        self._local = self._agent.prep_xfer_dlist("NIXL_INIT_AGENT", table, mem_type, backends=[backend])
        self._remotes: dict[str, Remote] = {}
        self._faults = FaultInjector()

    def connect(self, info: AgentInfo) -> None:
        known = self._remotes.get(info.agent_name)
        if known is not None and known.info == info:
            return
        peers = plan_peers(self.layout, info, self.staging_bytes)
        if known is not None:
            self.disconnect(known.info.agent_name)
        agent = self._live_agent()
        if any(peer.staged for peer in peers):
            self._staging.register(agent)
        connect_peers(agent, self.backend, peers)
        self._remotes[info.agent_name] = Remote(info, peers)

    def disconnect(self, agent_name: str) -> None:
        """Forget a source that left (its worker drained); unknown names are ignored."""
        known = self._remotes.pop(agent_name, None)
        if known is not None:
            disconnect_peers(self._live_agent(), known.peers)

    def inject_failures(self, n: int) -> None:
        self._faults.fail_next(n)

    def inject_failure_rate(self, rate: float, seed: int = 0) -> None:
        """Fail each later read with probability ``rate`` (0 turns it off), drawn from ``Random(seed)``."""
        self._faults.fail_at_rate(rate, seed)

    async def read(
        self, handle: KvHandle, remote_block_ids: list[int], local_block_ids: list[int], timeout: float,
        notify: bool = True, slots: list[int] | None = None,
    ) -> TransferStats:
        remote = self._remotes.get(handle.agent_name)
        if remote is None or not remote.staged:
            return await self._read(handle, remote_block_ids, local_block_ids, timeout, notify, slots)
        started = time.monotonic()
        async with self._staging.turn(handle, timeout):
            left = max(0.0, timeout - (time.monotonic() - started))
            return await self._read(handle, remote_block_ids, local_block_ids, left, notify, slots)

    async def _read(
        self, handle: KvHandle, remote_block_ids: list[int], local_block_ids: list[int], timeout: float,
        notify: bool, slots: list[int] | None = None,
    ) -> TransferStats:
        pending, stats = self._post(handle, remote_block_ids, local_block_ids, timeout, notify, slots)
        if pending is None:
            return stats
        await finish(pending)
        self._notify_after(handle, pending)
        return pending.timed(stats)

    def read_blocking(
        self, handle: KvHandle, remote_block_ids: list[int], local_block_ids: list[int], timeout: float,
        notify: bool = True, slots: list[int] | None = None,
    ) -> TransferStats:
        if self._staging.in_use:
            raise RuntimeError(f"KV sink {self.agent_name}: a blocking read while an async read stages "
                               f"(call every method from one thread)")
        pending, stats = self._post(handle, remote_block_ids, local_block_ids, timeout, notify, slots)
        if pending is None:
            return stats
        finish_blocking(pending)
        self._notify_after(handle, pending)
        return pending.timed(stats)

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
        for name in list(self._remotes):
            self.disconnect(name)
        try:
            self._local.release()
            self._agent.deregister_memory(self._reg, backends=[self.backend])
            self._staging.deregister(self._agent)
        except Exception:  # noqa: BLE001 - best effort on shutdown
            logger.exception("closing KV sink %s failed", self.agent_name)
        self._agent = None

    def _remote(self, handle: KvHandle) -> Remote:
        remote = self._remotes.get(handle.agent_name)
        if remote is None:
            raise TransferError("unknown_agent", f"source {handle.agent_name!r} is not connected")
        return remote

    def _post(
        self, handle: KvHandle, remote_block_ids: list[int], local_block_ids: list[int], timeout: float,
        notify: bool, slots: list[int] | None = None,
    ) -> tuple[PendingRead | None, TransferStats]:
        """Check, then post the READs (one per source rank); ``None`` when there was nothing to move."""
        self._faults.check(handle.request_id)
        remote = self._remote(handle)
        plan = plan_read(handle, remote, self.layout, remote_block_ids, local_block_ids, self._staging,
                         self.backend, slots)
        now = time.time()
        if handle.lease_deadline <= now:
            raise TransferError("expired", f"lease of {handle.request_id} ended before the read")
        agent = self._live_agent()
        notif = (DONE_PREFIX + handle.request_id).encode() if notify else b""
        if plan.empty:
            if notify:
                self._send(remote.nixl_name, notif)
            return None, plan.stats
        # one READ to rank 0 carries the notification itself; otherwise it follows every READ
        carried = notif if plan.carries_notification(remote) else b""
        outcome = "timeout" if now + timeout <= handle.lease_deadline else "expired"
        pending = PendingRead(agent, handle.request_id, min(timeout, handle.lease_deadline - now), outcome,
                              b"" if carried else notif, self._kv_cache, self.layout, self._staging,
                              self._mem_type)
        pending.post(plan, self._local, carried)
        self._pump.kick()  # the READs' notification goes out only while this agent progresses
        return pending, plan.stats

    def _notify_after(self, handle: KvHandle, pending: PendingRead) -> None:
        if pending.notify_after:
            self._send(self._remote(handle).nixl_name, pending.notify_after)
        else:
            self._pump.kick()  # the notification a READ carried completes only while we progress

    def _send(self, nixl_name: str, notif: bytes) -> None:
        """Send a notification and progress at the fast cadence until it has gone out."""
        self._live_agent().send_notif(nixl_name, notif)
        self._pump.kick()

    def _live_agent(self) -> nixl_agent:
        if self._agent is None:
            raise RuntimeError(f"KV sink {self.agent_name} is closed")
        return self._agent

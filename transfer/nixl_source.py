"""The prefill side of a KV transfer: expose the KV cache to NIXL and track leases.

Contract
--------
- The source registers the worker's whole KV cache tensor with NIXL once, at
  construction, and publishes an :class:`AgentInfo` (``agent_info()``) that sinks use
  to connect. It never moves bytes itself: sinks READ from it one-sidedly.
- The source does **not** own blocks. The prefill worker's KV manager pins a request's
  blocks, calls ``add_lease(request_id, deadline)`` and hands decode a ``KvHandle``
  carrying the same deadline. The source only tracks the lease.
- Notification protocol (sink -> source, NIXL notifications, UTF-8):
  ``done:<request_id>`` is posted together with the sink's READ, so NIXL delivers it
  only after the READ has completed; ``release:<request_id>`` is sent when decode
  abandons a handle without (successfully) reading it (abort, failure, retry
  elsewhere). Either one ends the lease, as does ``end_lease`` when the prefill worker
  frees the blocks itself (the router's release or abort of the request): an ended
  lease is never reported as expired.
- ``poll(now)`` drains notifications and returns ``(released, expired)``: the request
  ids whose lease ended by notification and those whose deadline passed
  (``deadline <= now``, ``time.time()`` seconds). Each id is reported once; the
  caller then frees the blocks (freeing is idempotent per owner on the block pool).
  Notifications for unknown or already-ended leases are ignored.
- Deadline behaviour: after the deadline the blocks may be freed and reused, so a
  sink refuses to read a handle whose lease has expired and never waits past it.
  The prefill worker must call ``poll`` regularly (each scheduler step or idle tick)
  so that nothing stays pinned longer than its lease.
- ``add_lease`` on an id that already holds a lease replaces its deadline.
- Progress: a READ completes only while the source's NIXL agent progresses (true on
  a CPU-only host with UCX over cma + TCP; see ``transfer/agent.py``). A ``ProgressPump`` thread
  does that every millisecond while a lease is held (every ``IDLE_INTERVAL_S`` while
  none is; always every millisecond with ``always_in_flight``, for a tensor-parallel
  rank whose leases live on rank 0) and keeps the notifications for ``poll``; NIXL's own
  busy-spinning progress thread is off unless ``progress_thread=True`` (see
  ``transfer/agent.py``); ``pump_clock`` is its clock (the linger of a new lease's kick).
- Single-threaded: call every method from one thread (the worker's event loop).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch
from nixl._api import nixl_agent

from transfer.agent import ProgressPump, new_agent
from transfer.compat import compat_hash
from transfer.wire import WIRE_VERSION, AgentInfo, KvLayout

logger = logging.getLogger(__name__)

DONE_PREFIX = "done:"
RELEASE_PREFIX = "release:"
PROGRESS_INTERVAL_S = 0.001


def check_tensor(kv_cache: torch.Tensor, layout: KvLayout, scales: torch.Tensor | None = None) -> None:
    """The tensor (and the scales of a quantized cache) must be contiguous and match the layout exactly."""
    if (scales is None) != (layout.scale_region_bytes == 0):
        raise ValueError("KV scales must be given exactly when the layout has scale regions")
    if scales is not None:
        if tuple(scales.shape) != layout.scales_shape or not scales.is_contiguous():
            raise ValueError(f"KV scales {tuple(scales.shape)} do not match layout {layout.scales_shape}")
        if scales.device != kv_cache.device:
            raise ValueError("KV scales must live on the KV cache's device")
    if tuple(kv_cache.shape) != layout.shape:
        raise ValueError(f"KV cache shape {tuple(kv_cache.shape)} does not match layout {layout.shape}")
    if kv_cache.element_size() != layout.element_size:
        raise ValueError(f"KV cache element size {kv_cache.element_size()} != layout {layout.element_size}")
    if not kv_cache.is_contiguous():
        raise ValueError("KV cache tensor must be contiguous")


def tensor_placement(kv_cache: torch.Tensor) -> tuple[str, int]:
    """NIXL memory type and device id of a tensor."""
    return ("VRAM", kv_cache.get_device()) if kv_cache.is_cuda else ("DRAM", 0)


class KvSource:
    """Registers a KV cache for remote READs and tracks per-request leases."""

    def __init__(
        self,
        kv_cache: torch.Tensor,
        layout: KvLayout,
        agent_name: str,
        backend: str = "UCX",
        *,
        progress_thread: bool = False,
        scales: torch.Tensor | None = None,
        always_in_flight: bool = False,
        pump_clock: Callable[[], float] = time.monotonic,
    ) -> None:
        check_tensor(kv_cache, layout, scales)
        self.layout = layout
        self.agent_name = agent_name
        self.backend = backend
        self._kv_cache = kv_cache  # keep the registered memory alive
        self._scales = scales
        self._agent: nixl_agent | None = new_agent(agent_name, backend, progress_thread)
        tensors = kv_cache if scales is None else [kv_cache, scales]
        self._reg = self._agent.register_memory(tensors, backends=[backend])
        self._leases: dict[str, float] = {}
        self._pump = ProgressPump(self._agent, agent_name, PROGRESS_INTERVAL_S,
                                  busy=lambda: always_in_flight or bool(self._leases), clock=pump_clock)
        mem_type, device_id = tensor_placement(kv_cache)
        self._info = AgentInfo(
            wire_version=WIRE_VERSION,
            compat_hash=compat_hash(layout),
            agent_name=agent_name,
            metadata=self._agent.get_agent_metadata(),
            base_addr=kv_cache.data_ptr(),
            device_id=device_id,
            mem_type=mem_type,
            layout=layout,
            scales_addr=scales.data_ptr() if scales is not None else 0,
        )

    def agent_info(self) -> AgentInfo:
        return self._info

    def add_lease(self, request_id: str, deadline: float) -> None:
        self._leases[request_id] = deadline
        self._pump.kick()  # a sink may READ now: progress at the fast cadence

    def num_leases(self) -> int:
        return len(self._leases)

    def end_lease(self, request_id: str) -> bool:
        """Forget a lease the owner ended itself (the caller frees the blocks); True when it was held."""
        return self._leases.pop(request_id, None) is not None

    def poll(self, now: float | None = None) -> tuple[list[str], list[str]]:
        """Drain notifications; return ``(released, expired)`` request ids, each reported once."""
        released: list[str] = []
        for message in self._pump.take() if self._agent is not None else []:
            request_id = _parse_notif(message)
            if request_id is not None and self._leases.pop(request_id, None) is not None:
                released.append(request_id)
        now = time.time() if now is None else now
        expired = [rid for rid, deadline in self._leases.items() if deadline <= now]
        for rid in expired:
            del self._leases[rid]
        return released, expired

    def close(self) -> None:
        """Deregister the memory and destroy the agent; leases are forgotten (idempotent)."""
        if self._agent is None:
            return
        self._pump.stop()
        try:
            self._agent.deregister_memory(self._reg, backends=[self.backend])
        except Exception:  # noqa: BLE001 - best effort on shutdown
            logger.exception("deregistering KV memory of %s failed", self.agent_name)
        self._agent = None
        self._leases.clear()


def _parse_notif(message: str) -> str | None:
    for prefix in (DONE_PREFIX, RELEASE_PREFIX):
        if message.startswith(prefix):
            return message[len(prefix) :]
    logger.warning("ignoring unknown KV notification %r", message)
    return None

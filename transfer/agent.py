"""NIXL agent construction and the progress pump shared by source and sink.

NIXL's own progress thread (``enable_prog_thread``) busy-spins a whole core while
idle (the Python API fixes its delay at 0), which starves model compute on small
hosts. Without it, UCX only progresses inside NIXL calls, and a READ does not
complete unless the *source* progresses too (on a CPU-only host UCX picks cma
zero-copy for the data but TCP for its control lanes: a READ stays ``PROC`` once
the source stops calling into NIXL). ``ProgressPump`` is the middle ground: a daemon thread that calls
``get_new_notifs`` every ``interval`` seconds (this drives UCX progress) and keeps
the notifications for the owner. Agents run with ``NIXL_THREAD_SYNC_STRICT`` so
the pump and the owner's thread may call into NIXL concurrently.

Cadence: the pump progresses every ``interval`` seconds only while its owner has
transfers in flight, and every ``idle_interval`` seconds (``IDLE_INTERVAL_S``)
otherwise, so an idle or computing worker does not wake a thousand times a second on
a core the model needs. "In flight" is ``busy()`` (the source: a lease is held, a sink may READ any moment)
or a ``kick()`` less than ``linger`` seconds ago (the sink: it posted a READ or sent a
notification, which completes only while it progresses), by the pump's ``clock``
(``time.monotonic``); ``next_wait()`` is the pause before the next progress. ``kick`` also
wakes the thread at once.

Read threads (sink side, UCX only): on a CPU-only host UCX moves a READ's bytes with
cma (``process_vm_readv``), one kernel copy per descriptor on the thread that posts
it, which reaches about two thirds of a user-space ``memmove`` on one core
(docs/benchmarks.md, "KV transfer over NIXL"). With
``read_threads = n > 0`` the UCX backend runs its thread-pool engine (init params
``num_threads=n``, ``split_batch_size=n``): every READ of at least ``n`` descriptors
is split into ``n`` equal runs of descriptors, each posted and progressed by its own
UCX worker thread, so ``n`` cores copy at once. The threads block while no READ is
in flight (no idle CPU). ``default_read_threads`` gives the default: the
environment variable ``PDSERVE_KV_READ_THREADS`` when set (``0`` turns the pool off),
else ``min(2, cores)`` for host memory and 0 for GPU memory (there a NIC or copy
engine moves the bytes; more CPU threads do not add bandwidth). The user's own
``UCX_*`` environment variables reach UCX unchanged; pdserve sets none.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t

logger = logging.getLogger(__name__)

READ_THREADS_ENV = "PDSERVE_KV_READ_THREADS"
MAX_DEFAULT_READ_THREADS = 2
IDLE_INTERVAL_S = 0.05
LINGER_S = 0.1


def default_read_threads(mem_type: str) -> int:
    """UCX read threads for a sink on ``mem_type`` (``"DRAM"`` or ``"VRAM"``); see the module doc."""
    value = os.environ.get(READ_THREADS_ENV, "").strip()
    if value:
        try:
            threads = int(value)
        except ValueError:
            raise ValueError(f"{READ_THREADS_ENV} must be a whole number >= 0, got {value!r}") from None
        if threads < 0:
            raise ValueError(f"{READ_THREADS_ENV} must be a whole number >= 0, got {value!r}")
        return threads
    if mem_type != "DRAM":
        return 0
    threads = min(MAX_DEFAULT_READ_THREADS, len(os.sched_getaffinity(0)))
    return threads if threads > 1 else 0


def new_agent(agent_name: str, backend: str, progress_thread: bool, read_threads: int = 0) -> nixl_agent:
    """A NIXL agent with ``backend``; ``read_threads > 0`` (UCX only) splits large READs across threads."""
    config = nixl_agent_config(
        enable_prog_thread=progress_thread,
        backends=[],
        sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
    )
    agent = nixl_agent(agent_name, config)
    params: dict[str, str] = {}
    if read_threads > 0 and backend == "UCX":
        params = {"num_threads": str(read_threads), "split_batch_size": str(read_threads)}
    agent.create_backend(backend, params)
    return agent


class ProgressPump:
    """Progresses ``agent`` from a daemon thread and collects (or drops) its notifications."""

    def __init__(self, agent: nixl_agent, name: str, interval: float, keep_notifs: bool = True, *,
                 busy: Callable[[], bool] | None = None, idle_interval: float = IDLE_INTERVAL_S,
                 linger: float = LINGER_S, clock: Callable[[], float] = time.monotonic) -> None:
        self._agent = agent
        self._clock = clock
        self._interval = interval
        self._idle_interval = max(interval, idle_interval)
        self._busy = busy
        self._linger = linger
        self._busy_until = 0.0
        self._keep = keep_notifs
        self._lock = threading.Lock()
        self._messages: list[str] = []
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"nixl-progress-{name}", daemon=True)
        self._thread.start()

    def take(self) -> list[str]:
        """Notifications received since the last call (also progresses once now)."""
        self._pump()
        with self._lock:
            messages, self._messages = self._messages, []
        return messages

    def kick(self) -> None:
        """Progress every ``interval`` for the next ``linger`` seconds, starting now."""
        self._busy_until = self._clock() + self._linger
        self._wake.set()

    def in_flight(self) -> bool:
        return self._clock() < self._busy_until or (self._busy is not None and self._busy())

    def next_wait(self) -> float:
        """Seconds the thread waits before its next progress (unless kicked): the cadence."""
        return self._interval if self.in_flight() else self._idle_interval

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=5.0)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.next_wait())
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self._pump()
            except Exception:  # noqa: BLE001 - keep pumping; NIXL logs the cause
                logger.exception("NIXL progress failed")

    def _pump(self) -> None:
        notifs = self._agent.get_new_notifs()
        if notifs and self._keep:
            received = [m.decode("utf-8", "replace") for msgs in notifs.values() for m in msgs]
            with self._lock:
                self._messages.extend(received)

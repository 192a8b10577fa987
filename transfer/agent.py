"""NIXL agent construction and the progress pump shared by source and sink.

NIXL's own progress thread (``enable_prog_thread``) busy-spins a whole core while
idle (the Python API fixes its delay at 0: 3.0 CPU-seconds per 3 idle seconds,
measured on a 2-core host), which starves model compute on small hosts. Without
it, UCX only progresses inside NIXL calls, and a READ does not complete unless the
*source* progresses too (measured on a CPU-only host, where UCX picks cma zero-copy
for the data but TCP for its control lanes: a READ stayed ``PROC`` for seconds once
the source stopped calling into NIXL). ``ProgressPump`` is the middle ground: a daemon thread that calls
``get_new_notifs`` every ``interval`` seconds (this drives UCX progress) and keeps
the notifications for the owner. Agents run with ``NIXL_THREAD_SYNC_STRICT`` so
the pump and the owner's thread may call into NIXL concurrently.
"""

from __future__ import annotations

import logging
import threading

from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t

logger = logging.getLogger(__name__)


def new_agent(agent_name: str, backend: str, progress_thread: bool) -> nixl_agent:
    config = nixl_agent_config(
        enable_prog_thread=progress_thread,
        backends=[backend],
        sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
    )
    return nixl_agent(agent_name, config)


class ProgressPump:
    """Progresses ``agent`` from a daemon thread and collects (or drops) its notifications."""

    def __init__(self, agent: nixl_agent, name: str, interval: float, keep_notifs: bool = True) -> None:
        self._agent = agent
        self._interval = interval
        self._keep = keep_notifs
        self._lock = threading.Lock()
        self._messages: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"nixl-progress-{name}", daemon=True)
        self._thread.start()

    def take(self) -> list[str]:
        """Notifications received since the last call (also progresses once now)."""
        self._pump()
        with self._lock:
            messages, self._messages = self._messages, []
        return messages

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
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

"""``GroupWatch``: a tensor-parallel worker lives and dies as one group.

A serving worker of N ranks is one Ray actor (rank 0) and N-1 processes it started
(``engine/tp_ranks.py``). The watch, a daemon thread in the actor, checks every ``interval`` seconds
that every rank process is alive and that the engine loop has not failed (a hung rank is a
``TpError`` there after ``tp_timeout_s``). On either it stops every rank process left and ends the
actor's process (``os._exit``): Ray then sees the actor die and restarts it (``--max-restarts``) with
a fresh group, and the router treats it as any dead worker: a decode worker's requests migrate with
their tokens so far (``--migration-limit``), a prefill worker's are retried or recomputed
(``--kv-failure-policy``). A rank process whose rank 0 died ends too (its parent-death signal, and at
the latest its next collective's deadline), so no process of a broken group is left waiting.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

from engine.tp_ranks import RankProcesses

log = logging.getLogger(__name__)

EXIT_CODE = 70


class GroupWatch:
    def __init__(self, ranks: RankProcesses, engine_error: Callable[[], BaseException | None], name: str,
                 interval: float = 0.2, exit: Callable[[int], None] = os._exit) -> None:
        self.ranks, self.engine_error, self.name, self.interval = ranks, engine_error, name, interval
        self._exit = exit
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tp-watch", daemon=True)

    def start(self) -> GroupWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def problem(self) -> str | None:
        dead = [rank for rank, alive in enumerate(self.ranks.alive(), start=1) if not alive]
        if dead:
            return f"rank process(es) {dead} died"
        error = self.engine_error()
        return None if error is None else f"the engine loop failed: {error!r}"

    def exit_if_broken(self) -> None:
        """End the process now when the group is broken (a caller about to answer a request's failure
        calls this first: the request then sees the worker die, and migrates or retries)."""
        problem = self.problem()
        if problem is not None:
            self._end(problem)

    def _end(self, problem: str) -> None:
        log.error("%s: tensor-parallel group broken (%s): stopping every rank and exiting for a restart",
                  self.name, problem)
        self.ranks.grace_s = 1.0
        try:
            self.ranks.close()
        finally:
            self._exit(EXIT_CODE)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            problem = self.problem()
            if problem is not None:
                self._end(problem)
                return

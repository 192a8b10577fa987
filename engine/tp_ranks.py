"""The rank processes of one tensor-parallel engine, started and stopped by the process that holds rank 0.

``RankProcesses(model, config)`` hosts the group's rendezvous (``TpGroup`` rank 0, in this process)
and starts ranks 1..N-1 as ``multiprocessing`` *spawn* children (no Ray: the offline ``LLM`` needs
none; a fork of a process holding torch threads is unsafe). Each child loads its own slice of the
weights (``build_runner``) and runs ``ModelRunner.follow`` until rank 0 sends ``Stop`` or the group
breaks. A child gets only plain values (rank, size, port, the model path, the engine config as
msgspec JSON), never a pickled object of ours.

Clean-up (``close``, idempotent): ``Stop`` to the children, join them, terminate (then kill) any that
is still there after ``grace_s``. The children are daemonic, so they also end with this process, and a
child whose rank 0 died raises ``TpError`` at its next collective (gloo sees the closed connection;
at the latest the group's deadline) and exits.
"""

from __future__ import annotations

import logging
import multiprocessing
import sys
from multiprocessing.process import BaseProcess
from pathlib import Path

import msgspec

from engine.config import EngineConfig
from engine.tp_group import TpError, TpGroup

log = logging.getLogger(__name__)


def rank_main(rank: int, size: int, port: int, model: str, config_json: bytes) -> None:
    """Entry point of rank ``rank`` (1..size-1): build the shard, follow rank 0's plans."""
    from engine.engine import build_runner
    from engine.loader import load_model_source

    config = msgspec.json.decode(config_json, type=EngineConfig)
    group = TpGroup(rank, size, port, config.tp_timeout_s, config.device)
    try:
        build_runner(load_model_source(model), config, group).follow()
    except TpError as exc:
        log.error("tensor-parallel rank %d stops: %s", rank, exc)
        sys.exit(1)
    finally:
        group.close()


class RankProcesses:
    """Rank 0's group (``group``, to hand to ``LLMEngine``) and the processes of ranks 1..N-1."""

    def __init__(self, model: str | Path, config: EngineConfig, grace_s: float = 10.0) -> None:
        size = config.tensor_parallel_size
        self.grace_s = grace_s
        self.group = TpGroup(0, size, 0, config.tp_timeout_s, config.device)
        ctx = multiprocessing.get_context("spawn")
        payload = msgspec.json.encode(config)
        self.processes: list[BaseProcess] = [
            ctx.Process(target=rank_main, args=(rank, size, self.group.port, str(model), payload),
                        name=f"pdserve-tp-rank{rank}", daemon=True)
            for rank in range(1, size)
        ]
        for proc in self.processes:
            proc.start()

    def alive(self) -> list[bool]:
        return [proc.is_alive() for proc in self.processes]

    def close(self) -> None:
        """Stop every rank process (see the module docstring); idempotent."""
        self.group.close()
        for proc in self.processes:
            proc.join(timeout=self.grace_s)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=self.grace_s)
            if proc.is_alive():  # a stopped process ignores SIGTERM; SIGKILL always ends it
                proc.kill()
                proc.join(timeout=max(self.grace_s, 5.0))

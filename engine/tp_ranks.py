"""The rank processes of one tensor-parallel engine, started and stopped by the process that holds rank 0.

``RankProcesses(model, config)`` hosts the group's rendezvous (``TpGroup`` rank 0, in this process)
and starts ranks 1..N-1 as ``multiprocessing`` *spawn* children (no Ray: the offline ``LLM`` needs
none; a fork of a process holding torch threads is unsafe). Each child loads its own slice of the
weights (``build_runner``) and runs ``ModelRunner.follow`` until rank 0 sends ``Stop`` or the group
breaks. A child gets only plain values (rank, size, port, the model path, the engine config as
msgspec JSON), never a pickled object of ours.

A caller that needs more of its ranks than the forward (a serving worker: each rank's NIXL agent, see
``worker/tp_kv.py``) names an ``extension``, ``"module:function"``: each child imports it and calls
``function(runner)``, which answers a ``RankExtension``: the ``Call`` handlers of that rank
(``TpGroup.call``) and what to close when the rank ends. The name is a plain string, so the engine
imports nothing of the layers above it.

Clean-up (``close``, idempotent): ``Stop`` to the children, join them, terminate (then kill) any that
is still there after ``grace_s``. The children are daemonic, so they also end with this process (and
within half a second when it dies some other way, even by SIGKILL: each watches its parent pid), and a
child whose rank 0 died raises ``TpError`` at its next collective (gloo sees the closed connection;
at the latest the group's deadline) and exits.
"""

from __future__ import annotations

import importlib
import logging
import multiprocessing
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, cast

from engine.config import EngineConfig
from engine.tp_group import TpError, TpGroup

if TYPE_CHECKING:
    from engine.model_runner import ModelRunner

log = logging.getLogger(__name__)


class RankExtension(Protocol):
    """What an ``extension`` adds to a rank: its ``Call`` handlers, and its clean-up."""

    handlers: Mapping[str, Callable[[bytes], bytes]]

    def close(self) -> None: ...


def load_extension(name: str) -> Callable[[ModelRunner], RankExtension]:
    """``"module:function"`` imported (a ``ValueError`` naming it when it is not there)."""
    module, _, function = name.partition(":")
    try:
        found = getattr(importlib.import_module(module), function)
        return cast("Callable[[ModelRunner], RankExtension]", found)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"tensor-parallel rank extension {name!r} not found: {exc}") from exc


def rank_main(rank: int, size: int, port: int, model: str, config_json: bytes, extension: str = "") -> None:
    """Entry point of rank ``rank`` (1..size-1): build the shard, follow rank 0's plans."""
    import msgspec

    from engine.loader import load_model_source
    from engine.runner_build import build_runner

    _end_with_parent()
    config = msgspec.json.decode(config_json, type=EngineConfig)
    group = TpGroup(rank, size, port, config.tp_timeout_s, config.device)
    ext: RankExtension | None = None
    try:
        runner = build_runner(load_model_source(model), config, group)
        ext = load_extension(extension)(runner) if extension else None
        runner.follow(ext.handlers if ext is not None else None)
    except TpError as exc:
        log.error("tensor-parallel rank %d stops: %s", rank, exc)
        sys.exit(1)
    finally:
        if ext is not None:
            ext.close()
        group.close()


def _end_with_parent(interval: float = 0.5) -> None:
    """End this process when the one that started it dies, however it died (a killed actor runs no exit
    handler): a daemon thread checks the parent pid every ``interval`` seconds. (``PR_SET_PDEATHSIG``
    would follow the starting *thread*, which in a Ray actor may end long before its process.)"""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(interval)
        os._exit(1)

    threading.Thread(target=watch, name="tp-parent-watch", daemon=True).start()


class RankProcesses:
    """Rank 0's group (``group``, to hand to ``LLMEngine``) and the processes of ranks 1..N-1."""

    def __init__(self, model: str | Path, config: EngineConfig, grace_s: float = 10.0,
                 extension: str = "") -> None:
        size = config.tensor_parallel_size
        self.grace_s = grace_s
        self.group = TpGroup(0, size, 0, config.tp_timeout_s, config.device)
        import msgspec  # only a group of several ranks needs it

        ctx = multiprocessing.get_context("spawn")
        payload = msgspec.json.encode(config)
        self.processes: list[BaseProcess] = [
            ctx.Process(target=rank_main, args=(rank, size, self.group.port, str(model), payload, extension),
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

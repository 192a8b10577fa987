"""Start prefill and decode workers as Ray actors (the worker classes themselves know nothing of Ray).

With ``WorkerOptions.placement_groups`` each worker first reserves its own
placement group (``cluster.placement``) on a node that offers the role's
resources, and the actor is scheduled into it. ``max_restarts`` lets Ray
restart a worker whose process died (the actor re-runs its constructor: a
fresh engine and a new NIXL agent; ``PDClient`` re-registers it). Actors are
named but never detached: they die with the driver that created them.

A group changes while serving: ``WorkerGroup.launch`` starts one more worker
(the next unused index: ``decode-2`` after ``decode-0`` and ``decode-1``, even
if one of those has left) in a new placement group, which on a Ray cluster
with an autoscaler is what makes Ray add a node; ``WorkerGroup.retire`` kills a
worker (no restart) and removes its placement group (``cluster.fleet`` drives
both).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
import uuid
from dataclasses import dataclass, field
from typing import Any

import ray

from cluster.config import LEASE_SECONDS
from cluster.placement import UNPLACED, WorkerOptions, release, reserve, scheduling
from decode.worker import DecodeWorker
from engine.config import EngineConfig
from messages.codec import pack, unpack
from prefill.worker import PrefillWorker
from telemetry.tracing import TraceConfig

log = logging.getLogger(__name__)


@dataclass
class Member:
    """One worker of a group: its id (``prefill-0``), role, actor and placement group (if any)."""

    worker_id: str
    role: str
    actor: Any
    placement_group: Any | None = None


@dataclass(frozen=True)
class Launcher:
    """How this group's workers are made: model, engine config, per-role options. ``launch`` starts one
    more (blocking: it waits for the worker's placement group, ``cluster.placement.reserve``)."""

    model: str | None
    engine_config: bytes
    prefill_opts: WorkerOptions
    decode_opts: WorkerOptions
    lease_seconds: float
    transfer_timeout: float
    prefix: str
    tracing: bytes | None
    transfer_failure_rate: float = 0.0  # fault injection (testing only), decode workers
    share_cores: bool = True  # idle workers lend cores to the others on their node (worker/core_share.py)

    def launch(self, role: str, index: int) -> Member:
        worker_id = f"{role}-{index}"
        name = f"{self.prefix}-{worker_id}"
        opts = self.prefill_opts if role == "prefill" else self.decode_opts
        engine_config = self.engine_config
        config = unpack(engine_config, EngineConfig)
        opts = dataclasses.replace(opts, tp=opts.tp or config.tensor_parallel_size)
        share = self.prefix if self.share_cores else None
        if config.tensor_parallel_size != opts.tp:  # the role's own size (--prefill-tp / --decode-tp)
            engine_config = pack(dataclasses.replace(config, tensor_parallel_size=opts.tp))
        pg = reserve(opts.placement(), name, opts.placement_timeout, opts.resources_flag) \
            if opts.placement_groups else None
        try:
            cls = _actor(PrefillWorker if role == "prefill" else DecodeWorker, name, opts, pg)
            if role == "prefill":
                actor = cls.remote(worker_id, self.model, engine_config,
                                   lease_seconds=self.lease_seconds, torch_threads=opts.threads,
                                   tracing=self.tracing, core_share=share)
            else:
                actor = cls.remote(worker_id, self.model, engine_config,
                                   transfer_timeout=self.transfer_timeout, torch_threads=opts.threads,
                                   tracing=self.tracing, transfer_failure_rate=self.transfer_failure_rate,
                                   core_share=share)
        except BaseException:
            if pg is not None:
                release([pg])
            raise
        return Member(worker_id, role, actor, pg)


@dataclass
class WorkerGroup:
    """The workers one driver owns. Members come and go while serving (``launch``, ``retire``);
    ``prefill`` / ``decode`` / ``all`` list the current actors."""

    members: list[Member] = field(default_factory=list)
    launcher: Launcher | None = None
    next_index: dict[str, int] = field(default_factory=lambda: {"prefill": 0, "decode": 0})
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def prefill(self) -> list[Any]:
        return [m.actor for m in self.members if m.role == "prefill"]

    @property
    def decode(self) -> list[Any]:
        return [m.actor for m in self.members if m.role == "decode"]

    @property
    def placement_groups(self) -> list[Any]:
        return [m.placement_group for m in self.members if m.placement_group is not None]

    def all(self) -> list[Any]:
        return self.prefill + self.decode

    def count(self, role: str) -> int:
        return sum(1 for m in self.members if m.role == role)

    def launch(self, role: str) -> Member:
        """Start one more worker of ``role`` with the next unused index (blocking, see ``Launcher``)."""
        if self.launcher is None:
            raise RuntimeError("this worker group cannot start workers")
        with self._lock:
            index = self.next_index[role]
            self.next_index[role] += 1
        member = self.launcher.launch(role, index)
        with self._lock:
            self.members.append(member)
        return member

    def retire(self, worker_id: str) -> bool:
        """Kill one worker's actor (no restart) and remove its placement group; False if unknown."""
        with self._lock:
            member = next((m for m in self.members if m.worker_id == worker_id), None)
            if member is None:
                return False
            self.members.remove(member)
        with contextlib.suppress(Exception):  # already dead
            ray.kill(member.actor, no_restart=True)
        if member.placement_group is not None:
            release([member.placement_group])
        return True

    def shutdown(self, timeout: float = 15.0) -> bool:
        """Kill every actor (no restart) and remove the placement groups, within ``timeout`` seconds.

        Ray's calls block while its control processes are unreachable (a Ctrl-C or a signal sent
        to the whole process group also stops the local raylet), so they run in a daemon thread:
        False when it did not finish in time, and the caller goes on with its own shutdown."""
        def work() -> None:
            for actor in self.all():
                with contextlib.suppress(Exception):  # already dead
                    ray.kill(actor, no_restart=True)
            release(self.placement_groups)

        thread = threading.Thread(target=work, name="pdserve-shutdown", daemon=True)
        thread.start()
        thread.join(timeout)
        if thread.is_alive():
            log.warning("Ray did not confirm the workers' shutdown within %.0f s; going on", timeout)
            return False
        return True


def worker_env(threads: int) -> dict[str, str]:
    """A worker process's environment: its OpenMP thread count, and torch's transparent huge pages for
    CPU tensors of 2 MB and more (``THP_MEM_ALLOC_ENABLE``; the driver's own value wins where it sets
    one). torch reads that switch once, at its first allocation, so it has to be there when the process
    starts (docs/benchmarks.md, "Huge pages for the weights")."""
    thp = os.environ.get("THP_MEM_ALLOC_ENABLE", "1")
    return {"OMP_NUM_THREADS": str(threads), "THP_MEM_ALLOC_ENABLE": thp}


def _actor(cls: type, name: str, opts: WorkerOptions, group: Any) -> Any:
    options: dict[str, Any] = {
        "name": name,
        "num_cpus": opts.num_cpus,
        "num_gpus": opts.actor_gpus,
        "resources": dict(opts.resources),
        "max_restarts": opts.max_restarts,
        "max_task_retries": 0,
        "max_concurrency": 1000,
        "runtime_env": {"env_vars": worker_env(opts.threads)},
    }
    if group is not None:
        options["scheduling_strategy"] = scheduling(group)
    return ray.remote(cls).options(**options)


def start_workers(
    model: str | None,
    engine_config: EngineConfig,
    num_prefill: int,
    num_decode: int,
    prefill_opts: WorkerOptions | None = None,
    decode_opts: WorkerOptions | None = None,
    lease_seconds: float = LEASE_SECONDS,
    transfer_timeout: float = 30.0,
    name_prefix: str | None = None,
    tracing: TraceConfig | None = None,
    transfer_failure_rate: float = 0.0,
    share_cores: bool = True,
) -> WorkerGroup:
    """Create the actors (they load the model in their own processes); call ``ready`` before use.

    With placement groups, raises TimeoutError naming the role's resources flag when a worker's
    reservation cannot be placed (the groups made so far are removed). With ``tracing`` (an OTLP
    endpoint) each worker exports its spans there. ``transfer_failure_rate`` > 0 makes the decode workers
    fail that fraction of KV pulls on purpose (fault injection for tests and chaos runs). ``share_cores``:
    workers run their steps on the threads of idle workers on their node too, both ways
    (``worker/core_share.py``)."""
    if num_decode < 1:
        raise ValueError("at least one decode worker is needed (--num-decode)")
    if num_prefill < 0:
        raise ValueError("--num-prefill cannot be negative")
    launcher = Launcher(model, pack(engine_config), prefill_opts or UNPLACED, decode_opts or UNPLACED,
                        lease_seconds, transfer_timeout, name_prefix or f"pdserve-{uuid.uuid4().hex[:6]}",
                        pack(tracing) if tracing is not None and tracing.endpoint else None,
                        transfer_failure_rate, share_cores)
    group = WorkerGroup(launcher=launcher)
    try:
        for _ in range(num_prefill):
            group.launch("prefill")
        for _ in range(num_decode):
            group.launch("decode")
    except BaseException:
        group.shutdown()
        raise
    return group

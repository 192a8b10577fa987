"""Start prefill and decode workers as Ray actors (the worker classes themselves know nothing of Ray).

With ``WorkerOptions.placement_groups`` each worker first reserves its own
placement group (``cluster.placement``) on a node that offers the role's
resources, and the actor is scheduled into it. ``max_restarts`` lets Ray
restart a worker whose process died (the actor re-runs its constructor: a
fresh engine and a new NIXL agent; ``PDClient`` re-registers it). Actors are
named but never detached: they die with the driver that created them.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import uuid
from dataclasses import dataclass, field
from typing import Any

import ray

from cluster.config import LEASE_SECONDS
from cluster.placement import UNPLACED, WorkerOptions, release, reserve, scheduling
from decode.worker import DecodeWorker
from engine.config import EngineConfig
from messages.codec import pack
from prefill.worker import PrefillWorker
from telemetry.tracing import TraceConfig

log = logging.getLogger(__name__)


@dataclass
class WorkerGroup:
    prefill: list[Any]
    decode: list[Any]
    placement_groups: list[Any] = field(default_factory=list)

    def all(self) -> list[Any]:
        return self.prefill + self.decode

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


def _actor(cls: type, name: str, opts: WorkerOptions, group: Any) -> Any:
    options: dict[str, Any] = {
        "name": name,
        "num_cpus": opts.num_cpus,
        "num_gpus": opts.num_gpus,
        "resources": dict(opts.resources),
        "max_restarts": opts.max_restarts,
        "max_task_retries": 0,
        "max_concurrency": 1000,
        "runtime_env": {"env_vars": {"OMP_NUM_THREADS": str(opts.torch_threads)}},
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
) -> WorkerGroup:
    """Create the actors (they load the model in their own processes); call ``ready`` before use.

    With placement groups, raises TimeoutError naming the role's resources flag when a worker's
    reservation cannot be placed (the groups made so far are removed). With ``tracing`` (an OTLP
    endpoint) each worker exports its spans there. ``transfer_failure_rate`` > 0 makes the decode workers
    fail that fraction of KV pulls on purpose (fault injection for tests and chaos runs)."""
    if num_decode < 1:
        raise ValueError("at least one decode worker is needed (--num-decode)")
    if num_prefill < 0:
        raise ValueError("--num-prefill cannot be negative")
    prefix = name_prefix or f"pdserve-{uuid.uuid4().hex[:6]}"
    popts = prefill_opts or UNPLACED
    dopts = decode_opts or UNPLACED
    cfg = pack(engine_config)
    trace = pack(tracing) if tracing is not None and tracing.endpoint else None
    group = WorkerGroup([], [])

    def place(name: str, opts: WorkerOptions) -> Any:
        if not opts.placement_groups:
            return None
        pg = reserve(opts.placement(), name, opts.placement_timeout, opts.resources_flag)
        group.placement_groups.append(pg)
        return pg

    try:
        for i in range(num_prefill):
            name = f"{prefix}-prefill-{i}"
            group.prefill.append(_actor(PrefillWorker, name, popts, place(name, popts)).remote(
                f"prefill-{i}", model, cfg, lease_seconds=lease_seconds, torch_threads=popts.torch_threads,
                tracing=trace))
        for i in range(num_decode):
            name = f"{prefix}-decode-{i}"
            group.decode.append(_actor(DecodeWorker, name, dopts, place(name, dopts)).remote(
                f"decode-{i}", model, cfg, transfer_timeout=transfer_timeout,
                torch_threads=dopts.torch_threads, tracing=trace,
                transfer_failure_rate=transfer_failure_rate))
    except BaseException:
        group.shutdown()
        raise
    return group

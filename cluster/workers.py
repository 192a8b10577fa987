"""Start prefill and decode workers as Ray actors (the worker classes themselves know nothing of Ray)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

import msgspec
import ray

from decode.worker import DecodeWorker
from engine.config import EngineConfig
from prefill.worker import PrefillWorker
from transfer.tracing import TraceConfig


@dataclass(frozen=True)
class WorkerOptions:
    """Placement and behaviour of one role's workers."""

    num_cpus: float = 1.0
    num_gpus: float = 0.0
    resources: dict[str, float] = field(default_factory=dict)
    max_restarts: int = 0
    torch_threads: int = 1


@dataclass
class WorkerGroup:
    prefill: list[Any]
    decode: list[Any]

    def all(self) -> list[Any]:
        return self.prefill + self.decode


def _actor(cls: type, name: str, opts: WorkerOptions) -> Any:
    return ray.remote(cls).options(
        name=name,
        num_cpus=opts.num_cpus,
        num_gpus=opts.num_gpus,
        resources=dict(opts.resources),
        max_restarts=opts.max_restarts,
        max_concurrency=1000,
    )


def start_workers(
    model: str | None,
    engine_config: EngineConfig,
    num_prefill: int,
    num_decode: int,
    prefill_opts: WorkerOptions | None = None,
    decode_opts: WorkerOptions | None = None,
    lease_seconds: float = 30.0,
    transfer_timeout: float = 30.0,
    name_prefix: str | None = None,
    tracing: TraceConfig | None = None,
) -> WorkerGroup:
    """Create the actors (they load the model in their own processes); call ``ready`` before use.
    With ``tracing`` (an OTLP endpoint) each worker exports its spans there."""
    if num_decode < 1:
        raise ValueError("at least one decode worker is needed (--num-decode)")
    if num_prefill < 0:
        raise ValueError("--num-prefill cannot be negative")
    prefix = name_prefix or f"pdserve-{uuid.uuid4().hex[:6]}"
    popts = prefill_opts or WorkerOptions()
    dopts = decode_opts or WorkerOptions()
    cfg = msgspec.msgpack.encode(engine_config)
    trace = msgspec.msgpack.encode(tracing) if tracing is not None and tracing.endpoint else None
    prefill = [
        _actor(PrefillWorker, f"{prefix}-prefill-{i}", popts).remote(
            f"prefill-{i}", model, cfg, lease_seconds=lease_seconds, torch_threads=popts.torch_threads,
            tracing=trace)
        for i in range(num_prefill)
    ]
    decode = [
        _actor(DecodeWorker, f"{prefix}-decode-{i}", dopts).remote(
            f"decode-{i}", model, cfg, transfer_timeout=transfer_timeout, torch_threads=dopts.torch_threads,
            tracing=trace)
        for i in range(num_decode)
    ]
    return WorkerGroup(prefill, decode)

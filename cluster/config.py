"""``ServeConfig``: everything one ``pdserve serve`` (or its Ray Serve application) runs with, frozen.

It lives in ``cluster/`` because this is where start-up lives: ``cluster.serve`` reads it to start
Ray, place the workers and hand each process its own frozen part (``engine`` to the workers,
``router`` and ``client`` to the router). It is built once, by ``cli.serve_config.serve_config_from_args``
from the parsed flags, ``--config`` file or Ray Serve args; nothing here knows argparse. Its defaults
are the flags' defaults: the parser reads them from ``SERVE_DEFAULTS``.

Three values are left to the process that runs the router, as before: the served model name
(``served_model_name=None``: the model file's name), ``router.api_key=None`` (``$PDSERVE_API_KEY``)
and the ``tracing`` values left ``None`` (the ``OTEL_*`` variables); see ``cluster.serve.prepare_service``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from cluster.placement import WorkerOptions
from engine.config import EngineConfig
from router.config import ClientConfig, RouterSettings
from telemetry.tracing import TraceConfig

LEASE_SECONDS = 30.0  # how long prefill keeps KV blocks for decode to pull (--lease-seconds)
SECRET_KEYS = frozenset({"api_key"})


@dataclass(frozen=True)
class TraceFlags:
    """``--otlp-traces-*``; ``None`` defers to the ``OTEL_*`` variables of the process resolving them."""

    endpoint: str | None = None
    protocol: str | None = None
    sample_ratio: float | None = None

    def resolve(self) -> TraceConfig:
        return TraceConfig.from_env(self.endpoint, self.protocol, self.sample_ratio)


def parse_slo(text: str, flag: str = "--slo") -> tuple[float, float]:
    """``ttft=1,itl=0.05`` (seconds; ``ms`` or ``s`` suffixes allowed) -> (TTFT p90, ITL p90) seconds."""
    out: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        key, value = key.strip().lower(), value.strip().lower()
        if not sep or key not in ("ttft", "itl"):
            raise ValueError(f"{flag}: expected ttft=SECONDS,itl=SECONDS, got {part!r}")
        scale = 1e-3 if value.endswith("ms") else 1.0
        try:
            seconds = float(value.removesuffix("ms").removesuffix("s")) * scale
        except ValueError:
            raise ValueError(f"{flag}: invalid time {value!r} for {key}") from None
        if not seconds > 0:
            raise ValueError(f"{flag}: {key} must be > 0")
        out[key] = seconds
    if set(out) != {"ttft", "itl"}:
        raise ValueError(f"{flag}: give both ttft and itl, e.g. ttft=1,itl=0.05")
    return out["ttft"], out["itl"]


@dataclass(frozen=True)
class PlannerOptions:
    """``--planner`` and its settings (``cluster.planning``). A bound left ``None`` is the role's
    starting count (``--num-prefill`` / ``--num-decode``); ``slo`` is (TTFT p90, ITL p90) in seconds."""

    enabled: bool = False
    profile: str | None = None
    min_prefill: int | None = None
    max_prefill: int | None = None
    min_decode: int | None = None
    max_decode: int | None = None
    slo: tuple[float, float] = (1.0, 0.05)
    interval: float = 10.0
    hysteresis: int = 3
    drain_deadline: float = 60.0

    def bounds(self, num_prefill: int, num_decode: int) -> tuple[int, int, int, int]:
        """(min prefill, max prefill, min decode, max decode); ValueError names the flag at fault."""
        lo_p = num_prefill if self.min_prefill is None else self.min_prefill
        hi_p = num_prefill if self.max_prefill is None else self.max_prefill
        lo_d = num_decode if self.min_decode is None else self.min_decode
        hi_d = num_decode if self.max_decode is None else self.max_decode
        if lo_p < 1 or num_prefill < 1:
            raise ValueError("--planner needs prefill workers: --num-prefill and --min-prefill must be >= 1")
        if lo_d < 1:
            raise ValueError("--min-decode must be >= 1")
        if not lo_p <= num_prefill <= hi_p:
            raise ValueError(f"--num-prefill {num_prefill} must lie within --min-prefill {lo_p} and "
                             f"--max-prefill {hi_p}")
        if not lo_d <= num_decode <= hi_d:
            raise ValueError(f"--num-decode {num_decode} must lie within --min-decode {lo_d} and "
                             f"--max-decode {hi_d}")
        return lo_p, hi_p, lo_d, hi_d

    def check(self, num_prefill: int, num_decode: int) -> None:
        if not self.enabled:
            return
        if not self.profile:
            raise ValueError("--planner needs --planner-profile PATH (write one with `pdserve profile`)")
        self.bounds(num_prefill, num_decode)


def _role(role: str) -> WorkerOptions:
    return WorkerOptions(resources_flag=f"--{role}-resources")


@dataclass(frozen=True)
class ServeConfig:
    """One serving cluster: where the router listens, how many workers of each role and where they
    run, and each process's frozen config. ``num_prefill=0`` runs prompts on the decode workers."""

    model: str | None = None
    served_model_name: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    address: str | None = None
    num_prefill: int = 1
    num_decode: int = 1
    lease_seconds: float = LEASE_SECONDS
    engine: EngineConfig = field(default_factory=EngineConfig)
    router: RouterSettings = field(default_factory=RouterSettings)
    client: ClientConfig = field(default_factory=ClientConfig)
    prefill: WorkerOptions = field(default_factory=lambda: _role("prefill"))
    decode: WorkerOptions = field(default_factory=lambda: _role("decode"))
    tracing: TraceFlags = field(default_factory=TraceFlags)
    inject_transfer_failures: float = 0.0  # fault injection (testing only): fraction of KV pulls failed
    share_cores: bool = True  # idle workers lend their threads to the others' steps on their node
    planner: PlannerOptions = field(default_factory=PlannerOptions)

    def __post_init__(self) -> None:
        if self.num_decode < 1 or self.num_prefill < 0:
            raise ValueError("--num-decode must be >= 1 and --num-prefill >= 0")
        if not 0.0 <= self.inject_transfer_failures <= 1.0:
            raise ValueError("--inject-transfer-failures must be within [0, 1]")
        self.planner.check(self.num_prefill, self.num_decode)

    @property
    def colocated(self) -> bool:
        """No prefill workers: the decode workers run the prompts too."""
        return self.num_prefill == 0

    def check_local(self) -> None:
        """Raise ValueError when node selectors are given for the local Ray instance pdserve starts
        (no ``address``): it has no custom resources or labels, so the workers could never be placed."""
        if self.address is not None:
            return
        for key in ("prefill_resources", "decode_resources", "prefill_labels", "decode_labels"):
            if setting(self, key):
                flag = "--" + key.replace("_", "-")
                raise ValueError(f"{flag} selects nodes of a Ray cluster: give its --address (e.g. auto); "
                                 "the local instance pdserve starts has no custom resources or labels")


SERVE_DEFAULTS = ServeConfig()
# EngineConfig fields no flag sets (they keep their defaults under `pdserve serve`)
ENGINE_WITHOUT_FLAG = frozenset({
    "prefix_wait_min_tokens",
    "pad_decode_steps",  # a test option (engine/graph_runner.py)
    "num_threads",  # the workers take --torch-threads (pdserve serve) and torch's default (generate)
})

# Each setting (a flag's dest, and its --config / Ray Serve key) -> where it lands in ServeConfig.
# Flags shared by both roles land in both; the prefill one is read back.
SETTINGS: dict[str, tuple[str, ...]] = {
    "model": ("model",), "served_model_name": ("served_model_name",), "host": ("host",),
    "port": ("port",), "address": ("address",), "num_prefill": ("num_prefill",),
    "num_decode": ("num_decode",), "lease_seconds": ("lease_seconds",),
    **{name: (f"router.{name}",) for name in RouterSettings.__dataclass_fields__},
    **{name: (f"client.{name}",) for name in ("kv_failure_policy", "routing", "disagg_min_tokens",
                                              "prefill_saturation_tokens", "migration_limit")},
    "worker_cpus": ("prefill.num_cpus", "decode.num_cpus"),
    **{name: (f"prefill.{name}", f"decode.{name}") for name in ("torch_threads", "max_restarts",
                                                                 "placement_timeout")},
    **{f"{role}_{name}": (f"{role}.{name}",) for role in ("prefill", "decode")
       for name in ("resources", "labels", "tp")},
    "otlp_traces_endpoint": ("tracing.endpoint",), "otlp_traces_protocol": ("tracing.protocol",),
    "otlp_traces_sample_ratio": ("tracing.sample_ratio",),
    "inject_transfer_failures": ("inject_transfer_failures",), "share_cores": ("share_cores",),
    "planner": ("planner.enabled",), "planner_profile": ("planner.profile",),
    **{f"{edge}_{role}": (f"planner.{edge}_{role}",) for edge in ("min", "max")
       for role in ("prefill", "decode")},
    "slo": ("planner.slo",), "planner_interval": ("planner.interval",),
    "planner_hysteresis": ("planner.hysteresis",), "planner_drain_deadline": ("planner.drain_deadline",),
}


def setting(config: ServeConfig, key: str) -> Any:
    """The value of setting ``key`` (a flag's dest; an engine flag's dest is its EngineConfig field)."""
    paths = SETTINGS.get(key, (f"engine.{key}",))
    value: Any = config
    for part in paths[0].split("."):
        value = getattr(value, part)
    return value


def setting_keys() -> list[str]:
    """Every setting, the engine's included, sorted."""
    engine = [k for k in EngineConfig.__dataclass_fields__ if k not in ENGINE_WITHOUT_FLAG]
    return sorted([*SETTINGS, *engine])


def describe(config: ServeConfig) -> str:
    """``key: value`` for every setting (the keys of a ``--config`` file), one per line, sorted,
    secrets masked."""
    lines = []
    for key in setting_keys():
        value = setting(config, key)
        shown = "***" if key in SECRET_KEYS and value else value
        lines.append(f"  {key.replace('_', '-')}: {shown}")
    return "\n".join(lines)

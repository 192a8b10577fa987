"""How the router's PD client routes, retries and waits (one frozen config, built by the CLI)."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class KvFailurePolicy(enum.StrEnum):
    RETRY = "retry"
    RECOMPUTE = "recompute"
    FAIL = "fail"


@dataclass(frozen=True)
class ClientConfig:
    kv_failure_policy: KvFailurePolicy = KvFailurePolicy.RETRY
    routing: str = "round-robin"
    disagg_min_tokens: int = 0
    prefill_saturation_tokens: int = 1 << 30
    migration_limit: int = 1
    prefill_timeout: float = 120.0
    call_timeout: float = 30.0
    stream_timeout: float = 300.0
    refresh_interval: float = 0.1
    pending_ttl: float = 30.0  # how long a prompt sent to a worker counts as held there, at most
    settle_ttl: float = 5.0  # ... and once served there, waiting for its KV events

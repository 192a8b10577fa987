"""The router process's frozen settings: how its PD client routes, retries and waits (``ClientConfig``),
and the HTTP limits a user sets (``RouterSettings``; ``RouterConfig`` adds what the model
decides). Built once by the CLI; their defaults are the flags' defaults (the parser reads them here)."""

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
    routing: str = "prefix"
    disagg_min_tokens: int = 0
    prefill_saturation_tokens: int = 32768
    migration_limit: int = 1
    prefill_timeout: float = 120.0
    call_timeout: float = 30.0
    stream_timeout: float = 300.0
    refresh_interval: float = 0.1  # worker stats and KV events while anything moves ...
    idle_refresh_interval: float = 1.0  # ... and once nothing has (router/worker_table.py)
    pending_ttl: float = 30.0  # how long a prompt sent to a worker counts as held there, at most
    settle_ttl: float = 5.0  # ... and once served there, waiting for its KV events


@dataclass(frozen=True, kw_only=True)
class RouterSettings:
    """The router's HTTP limits. ``api_key=None``: ``$PDSERVE_API_KEY`` of the router's process, else
    no key; ``max_queued_tokens=None``: no token limit; ``default_max_tokens=None``: up to the context."""

    api_key: str | None = None
    max_request_bytes: int = 1 << 20
    max_queued_requests: int = 256
    max_queued_tokens: int | None = None
    request_timeout: float = 600.0
    default_max_tokens: int | None = None


@dataclass(frozen=True)
class RouterConfig(RouterSettings):
    """How the router serves one model: the user's ``RouterSettings`` (keyword-only) plus what the model
    decides, its served name and context length."""

    model_name: str
    max_model_len: int

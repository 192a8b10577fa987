"""Request-level messages between the client/router and the workers (msgspec, never pickle).

Ray carries these as ``bytes`` produced by ``pack`` and read back by ``unpack``
with an explicit type, so every process boundary we own has a typed, versioned
format. KV-level types (layouts, agent info, handles) live in ``transfer.wire``.
"""

from __future__ import annotations

from typing import TypeVar

import msgspec

T = TypeVar("T")


class SamplingSpec(msgspec.Struct, frozen=True, kw_only=True):
    """Wire form of ``engine.sampling.SamplingParams`` (same field names and defaults)."""

    n: int = 1
    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None


class GenerateRequest(msgspec.Struct, frozen=True, kw_only=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingSpec = SamplingSpec()
    priority: int = 0
    trace_context: dict[str, str] = {}


class TokenLogprob(msgspec.Struct, frozen=True):
    token_id: int
    logprob: float
    top: list[tuple[int, float]]


class PrefillResult(msgspec.Struct, frozen=True, kw_only=True):
    """What a prefill worker returns: the first token and where the prompt's K/V waits (``handle``)."""

    request_id: str
    first_token: int
    first_logprob: TokenLogprob | None
    handle_bytes: bytes
    cached_tokens: int
    finished: bool
    finish_reason: str | None


class ReservationInfo(msgspec.Struct, frozen=True, tag=True):
    request_id: str
    num_blocks: int
    num_cached_blocks: int


class TokenBatch(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """New tokens of one request since the last batch (one engine step or several)."""

    request_id: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    worker_id: str = ""


class HistogramData(msgspec.Struct, frozen=True, kw_only=True):
    """Bucket counts of a histogram: ``counts[i]`` observations in ``(bounds[i-1], bounds[i]]``; the
    last count is above every bound (``len(counts) == len(bounds) + 1``)."""

    bounds: list[float]
    counts: list[int]
    sum: float


class KvTierStats(msgspec.Struct, frozen=True, kw_only=True):
    """One KV tier of a worker (``engine.kv_sizing.KvTier`` on the wire): ``tier`` is ``device``,
    ``host`` or ``disk``; capacity and use in whole blocks of ``block_bytes`` (codes plus scales);
    ``hits`` counts blocks restored from an offload tier (0 for ``device``)."""

    tier: str
    capacity_blocks: int
    used_blocks: int
    block_bytes: int
    hits: int = 0


class WorkerStats(msgspec.Struct, frozen=True, kw_only=True):
    worker_id: str
    role: str
    num_running: int
    num_waiting: int
    num_kv_blocks: int
    num_free_kv_blocks: int
    num_used_blocks: int
    num_cached_blocks: int
    num_leases: int = 0
    num_reserved: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    num_preemptions: int = 0
    transfer_blocks: int = 0
    transfer_bytes: int = 0
    transfer_seconds: float = 0.0
    transfer_failures: int = 0
    leases_expired: int = 0
    pid: int = 0
    queue_time: HistogramData | None = None
    transfer_time: HistogramData | None = None
    num_stored_tokens: int = 0
    block_size: int = 0
    kv_cache_dtype: str = ""  # storage dtype name: float32, bfloat16, float16, fp8, fp8_e5m2, int8
    kv_tiers: list[KvTierStats] = []  # device first; host / disk only when configured


class KvEvents(msgspec.Struct, frozen=True):
    """Block hashes a worker's prefix cache gained and lost since the previous batch (in order).

    ``seq`` increases by one per batch so a reader can spot a gap and resync
    from a ``KvSnapshot`` (all hashes cached now).
    """

    worker_id: str
    seq: int
    stored: list[int]
    removed: list[int]


class KvSnapshot(msgspec.Struct, frozen=True):
    worker_id: str
    seq: int
    hashes: list[int]


class WorkerError(msgspec.Struct, frozen=True, tag=True):
    """An error a worker reports instead of raising across Ray (kind is machine-readable)."""

    kind: str
    message: str


class RequestFailed(RuntimeError):
    """A request could not be served; ``kind`` says why.

    Kinds: ``no_kv`` (no worker has KV room), ``invalid`` (the request is
    malformed), ``transfer`` (KV could not be moved and policy forbids a
    fallback), ``unavailable`` (no live worker), ``timeout``.
    """

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


_encoder = msgspec.msgpack.Encoder()


def pack(obj: object) -> bytes:
    return _encoder.encode(obj)


def unpack(data: bytes, type_: type[T]) -> T:
    return msgspec.msgpack.decode(data, type=type_)

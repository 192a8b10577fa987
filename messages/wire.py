"""Control-plane messages between the router and the workers (msgspec Structs, never pickle).

Ray carries them as ``bytes`` made by ``messages.codec.pack`` and read back by
``messages.codec.unpack`` with an explicit type. Parts are nested typed: a request
carries the engine's own ``SamplingParams``; a prefill result carries its
``transfer.wire.KvHandle``. KV-level types (layouts, agent info, handles) live in
``transfer.wire``; histogram data in ``telemetry.histogram``.

Errors: a worker never raises across Ray; it answers (or streams) a ``WorkerError``
whose ``kind`` is an ``ErrorKind``. The router turns it into ``RequestFailed`` with
the same kind, and the HTTP layer maps that kind to a status code in one place
(``router.errors.api_error``).
"""

from __future__ import annotations

import enum

import msgspec

from engine.sampling_params import SamplingParams
from telemetry.histogram import HistogramData
from transfer.wire import KvHandle


class GenerateRequest(msgspec.Struct, frozen=True, kw_only=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams = SamplingParams()
    priority: int = 0
    trace_context: dict[str, str] = {}


class TokenLogprob(msgspec.Struct, frozen=True):
    token_id: int
    logprob: float
    top: list[tuple[int, float]]


class PrefillResult(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """What a prefill worker returns: the first token and where the prompt's K/V waits (``handle``)."""

    request_id: str
    first_token: int
    first_logprob: TokenLogprob | None
    handle: KvHandle
    cached_tokens: int


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


class KvTierStats(msgspec.Struct, frozen=True, kw_only=True):
    """One KV tier of a worker (``engine.kv_sizing.KvTier`` on the wire): ``tier`` is ``device``,
    ``host`` or ``disk``; capacity and use in whole blocks of ``block_bytes`` (codes plus scales);
    ``hits`` counts blocks restored from an offload tier (0 for ``device``)."""

    tier: str
    capacity_blocks: int
    used_blocks: int
    block_bytes: int
    hits: int = 0


class RequestStats(msgspec.Struct, frozen=True, kw_only=True):
    """A worker's requests now: running, waiting in its scheduler, holding a reservation (decode);
    preemptions since start and the queue time histogram (engine arrival to first schedule)."""

    running: int = 0
    waiting: int = 0
    reserved: int = 0
    preemptions: int = 0
    queue_time: HistogramData | None = None


class KvStats(msgspec.Struct, frozen=True, kw_only=True):
    """A worker's paged KV cache: blocks in all, free, held by requests or leases, in the prefix cache;
    the tokens stored, the block size, the storage dtype (float32, bfloat16, float16, fp8, fp8_e5m2,
    int8, int4) and its tiers (device first; host / disk only when configured); prefix cache lookups and hits,
    in tokens, since start."""

    num_blocks: int = 0
    free_blocks: int = 0
    used_blocks: int = 0
    cached_blocks: int = 0
    evicted_tokens: int = 0  # --kv-eviction: tokens freed since start (engine/kv_eviction.py)
    # --kv-eviction: finished requests' kept share of their tokens; headwise: every layer's KV head budget
    # (tokens) at each finished request's last eviction
    kept_fraction: HistogramData | None = None
    head_budget: HistogramData | None = None
    stored_tokens: int = 0
    block_size: int = 0
    dtype: str = ""
    tiers: list[KvTierStats] = []
    prefix_queries: int = 0
    prefix_hits: int = 0


class LeaseStats(msgspec.Struct, frozen=True, kw_only=True):
    """A prefill worker's KV leases: held now, and expired before decode pulled them since start."""

    held: int = 0
    expired: int = 0


class TransferStats(msgspec.Struct, frozen=True, kw_only=True):
    """A decode worker's KV pulls since start: blocks, bytes and seconds of those that succeeded, the
    failed ones, and the seconds per pull as a histogram."""

    blocks: int = 0
    bytes: int = 0
    seconds: float = 0.0
    failures: int = 0
    time: HistogramData | None = None


class GrammarStats(msgspec.Struct, frozen=True, kw_only=True):
    """Grammar-constrained decoding since start (``engine.structured.StructuredStats``'s fields)."""

    constrained_requests: int = 0
    compiles: int = 0
    cache_hits: int = 0
    compile_seconds: float = 0.0
    mask_steps: int = 0
    mask_rows: int = 0
    mask_seconds: float = 0.0


class SpecDecodeStats(msgspec.Struct, frozen=True, kw_only=True):
    """Speculative decoding since start (``engine.spec_decode.SpecStats``'s fields); zero when it is off.
    ``accepted_per_pos``: accepted tokens by position in the draft (0: first)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = []


class StepStats(msgspec.Struct, frozen=True, kw_only=True):
    """The engine's steps since the worker started (``engine.async_engine.StepClock`` and its
    ``engine.step_work.StepTotals``, the same names): their count, wall seconds and the stepping
    thread's CPU seconds (wall / CPU: the host's stretch); then per kind of step, its count and wall
    seconds and what it computed: decode-only steps (requests stepped, their context tokens) and
    prompt-carrying steps (prompt tokens, attended (query, key) pairs), the terms the planner's profile
    prices a step in."""

    steps: int = 0
    wall_s: float = 0.0
    cpu_s: float = 0.0
    decode_steps: int = 0
    decode_wall_s: float = 0.0
    decode_rows: int = 0
    decode_context: int = 0
    prefill_steps: int = 0
    prefill_wall_s: float = 0.0
    prefill_tokens: int = 0
    prefill_attended: float = 0.0


class CoreShareStats(msgspec.Struct, frozen=True, kw_only=True):
    """Shared cores (``worker/core_share.py``) since start: this worker's steps that ran on other workers'
    threads too and those threads summed; its prompt chunks that asked the others for their threads, and
    the seconds they waited for busy ones to yield; its waits to get its own threads back, their seconds,
    the waits that gave up at the deadline, and the times it yielded its threads to an asking worker."""

    borrowed_steps: int = 0
    borrowed_threads: int = 0
    asked_steps: int = 0
    ask_seconds: float = 0.0
    reclaim_waits: int = 0
    reclaim_seconds: float = 0.0
    reclaim_late: int = 0
    yields: int = 0


class OutputStats(msgspec.Struct, frozen=True, kw_only=True):
    """A decode worker's output channels (``decode/outbox.py``) since start: Ray items sent and the
    stream items they carried (items / frames: requests served per Ray item)."""

    frames: int = 0
    items: int = 0


class WorkerStats(msgspec.Struct, frozen=True, kw_only=True):
    """One worker's figures, by concern (``GET /v1/workers`` answers them as JSON, nested the same way).
    A part that is not the worker's role's (leases on decode, transfers on prefill) stays at zero."""

    worker_id: str
    role: str
    pid: int = 0
    requests: RequestStats = msgspec.field(default_factory=RequestStats)
    kv: KvStats = msgspec.field(default_factory=KvStats)
    leases: LeaseStats = msgspec.field(default_factory=LeaseStats)
    transfer: TransferStats = msgspec.field(default_factory=TransferStats)
    grammar: GrammarStats = msgspec.field(default_factory=GrammarStats)
    spec: SpecDecodeStats = msgspec.field(default_factory=SpecDecodeStats)
    clock: StepStats = msgspec.field(default_factory=StepStats)
    cores: CoreShareStats = msgspec.field(default_factory=CoreShareStats)
    outputs: OutputStats = msgspec.field(default_factory=OutputStats)


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


class WorkerRefresh(msgspec.Struct, frozen=True):
    """What the router's periodic refresh reads from a worker in one call: its stats and, when
    asked for, the ``KvEvents`` since the previous batch (both read between the same two steps)."""

    stats: WorkerStats
    events: KvEvents | None = None


class ErrorKind(enum.StrEnum):
    """Why a request could not be served (machine-readable; the HTTP status follows from it)."""

    NO_KV = "no_kv"  # no KV room on the decode worker
    INVALID = "invalid"  # the request is malformed (the client's fault)
    PREFILL = "prefill"  # the prefill failed or timed out (its worker may be alive)
    PREFILL_DIED = "prefill_died"  # the prefill worker's process died
    TRANSFER = "transfer"  # the KV could not be pulled from the prefill worker
    ABORTED = "aborted"  # the request was aborted on the worker
    TIMEOUT = "timeout"  # a worker-side deadline passed
    UNAVAILABLE = "unavailable"  # no live worker could take it


class WorkerError(msgspec.Struct, frozen=True, tag=True):
    """What a worker answers or streams instead of raising across Ray."""

    kind: ErrorKind
    message: str

    @property
    def retryable(self) -> bool:
        """The decode worker kept the reservation: the caller may prefill elsewhere or recompute."""
        return self.kind in (ErrorKind.PREFILL, ErrorKind.PREFILL_DIED, ErrorKind.TRANSFER)


class StreamItem(msgspec.Struct, frozen=True, array_like=True):
    """One item of one attempt's stream on a decode worker's output channel: ``stream`` is the number
    the router gave that attempt (``DecodeWorker.submit``)."""

    stream: int
    item: TokenBatch | WorkerError


class OutputFrame(msgspec.Struct, frozen=True):
    """What a decode worker's output channel carries (``DecodeWorker.outputs``): every stream item
    made in one turn of its event loop (after an engine step: one per request that advanced), in
    order, as one Ray stream item instead of one per request."""

    items: list[StreamItem]

"""The router's Prometheus metrics, in a registry owned by one app (no process-global state).

Names follow vLLM's under a ``pdserve:`` prefix with vLLM's meanings. Observed at
the router, labelled ``model_name``: ``time_to_first_token_seconds`` (admission
to first text), ``inter_token_latency_seconds`` (between successive streamed
deltas of a request; one per decode step batch), ``e2e_request_latency_seconds``,
``prompt_tokens_total`` and ``generation_tokens_total``. From every worker's
``WorkerStats`` at scrape time, labelled ``worker`` and ``role``:
``num_requests_running``, ``num_requests_waiting``, ``kv_cache_usage_perc``
(0..1), ``prefix_cache_queries_total`` / ``prefix_cache_hits_total`` (tokens
looked up / found, as vLLM counts them), ``num_preemptions_total``, ``kv_evicted_tokens_total``,
``kv_kept_fraction`` and ``kv_head_budget_tokens`` (``--kv-eviction``; the last ``headwise`` only),
``request_queue_time_seconds``
(engine arrival to first schedule), ``kv_transfer_seconds`` (per pull, decode),
``kv_transfer_bytes_total``, ``kv_transfer_blocks_total``,
``kv_transfer_failures_total``, ``kv_lease_expired_total`` (prefill),
constrained decoding's ``structured_requests_total``, ``grammar_compiles_total``,
``grammar_cache_hits_total``, ``grammar_compile_seconds_total``,
``grammar_mask_steps_total`` and ``grammar_mask_seconds_total`` (masking time
inside steps), speculative decoding's ``spec_decode_num_drafts_total``,
``spec_decode_num_draft_tokens_total``, ``spec_decode_num_accepted_tokens_total`` and
``spec_decode_num_accepted_tokens_per_pos_total{position}`` (0 = first proposed token; decode
workers with ``--speculative-config``), plus the older ``worker_*`` gauges.
``routing_decisions_total{role,policy,reason}`` counts the client's routing choices.

Per KV tier, labelled ``worker``, ``role``, ``tier`` (``device``, ``host``,
``disk``) and ``kv_cache_dtype`` (``float32``, ``bfloat16``, ``float16``,
``fp8``, ``fp8_e5m2``, ``int8``, ``int4``): ``kv_cache_capacity_blocks``,
``kv_cache_capacity_tokens`` (blocks x block size), ``kv_cache_capacity_bytes``
(blocks x block bytes, scales included: the bytes the whole blocks take, at most
the configured budget), ``kv_cache_used_blocks`` (device: held by requests or
leases; host/disk: stored there) and ``kv_offload_hits_total`` (blocks restored
from the host or disk tier; their tokens also count in ``prefix_cache_hits_total``). A
tier that is not configured has no series at all (the device tier always has).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from messages.wire import HistogramData, KvTierStats, WorkerStats
from router.admission import AdmissionGate

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
# vLLM's buckets for inter-token and end-to-end latency (seconds).
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
               20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
               240.0, 480.0, 960.0, 1920.0, 7680.0)
Decisions = Mapping[tuple[str, str, str], int]


class RouterMetrics:
    def __init__(self, gate: AdmissionGate, model_name: str = "") -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        r = self.registry
        self.requests = Counter("pdserve:router_requests", "HTTP requests answered, by endpoint and status.",
                                ["endpoint", "status"], registry=r)
        self.ttft = Histogram("pdserve:router_time_to_first_token_seconds",
                              "Seconds from admission to the first generated text of a request.",
                              ["endpoint"], buckets=TTFT_BUCKETS, registry=r)
        self.output_tokens = Counter("pdserve:router_output_tokens", "Generated tokens returned to clients.",
                                     registry=r)
        self.time_to_first_token = Histogram(
            "pdserve:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
            ["model_name"], buckets=TTFT_BUCKETS, registry=r).labels(model_name)
        self.inter_token_latency = Histogram(
            "pdserve:inter_token_latency_seconds",
            "Histogram of seconds between successive streamed deltas of a request.",
            ["model_name"], buckets=ITL_BUCKETS, registry=r).labels(model_name)
        self.e2e_latency = Histogram(
            "pdserve:e2e_request_latency_seconds", "Histogram of end-to-end request latency in seconds.",
            ["model_name"], buckets=E2E_BUCKETS, registry=r).labels(model_name)
        self.prompt_tokens = Counter("pdserve:prompt_tokens", "Number of prefill tokens processed.",
                                     ["model_name"], registry=r).labels(model_name)
        self.generation_tokens = Counter("pdserve:generation_tokens",
                                         "Number of generation tokens processed.", ["model_name"],
                                         registry=r).labels(model_name)
        queued = Gauge("pdserve:router_queued_requests",
                       "Requests admitted and waiting for their first token.", registry=r)
        queued.set_function(lambda: gate.queued_requests)
        tokens = Gauge("pdserve:router_queued_prompt_tokens", "Prompt tokens of the queued requests.",
                       registry=r)
        tokens.set_function(lambda: gate.queued_tokens)
        flight = Gauge("pdserve:router_in_flight_requests", "Requests admitted and not yet answered in full.",
                       registry=r)
        flight.set_function(lambda: gate.in_flight)


Getter = Callable[[WorkerStats], float]
WORKER_GAUGES: dict[str, tuple[str, Getter]] = {
    "num_running": ("Requests running on the worker.", lambda s: s.requests.running),
    "num_waiting": ("Requests waiting on the worker.", lambda s: s.requests.waiting),
    "num_used_blocks": ("KV blocks held by requests or leases on the worker.", lambda s: s.kv.used_blocks),
    "num_free_kv_blocks": ("Free KV blocks on the worker.", lambda s: s.kv.free_blocks),
    "num_leases": ("KV leases the worker holds for decode to pull.", lambda s: s.leases.held),
}
VLLM_GAUGES: dict[str, tuple[str, Getter]] = {
    "num_requests_running": ("Number of requests in model execution batches.", lambda s: s.requests.running),
    "num_requests_waiting": ("Number of requests waiting to be processed.", lambda s: s.requests.waiting),
    "kv_cache_usage_perc": ("KV-cache usage. 1 means 100 percent usage.",
                            lambda s: s.kv.used_blocks / s.kv.num_blocks if s.kv.num_blocks else 0.0),
}
COUNTERS: dict[str, tuple[str, Getter]] = {
    "prefix_cache_queries": ("Prefix cache queries, in tokens looked up.", lambda s: s.kv.prefix_queries),
    "prefix_cache_hits": ("Prefix cache hits, in tokens found.", lambda s: s.kv.prefix_hits),
    "num_preemptions": ("Cumulative number of preemptions.", lambda s: s.requests.preemptions),
    "kv_evicted_tokens": ("KV tokens freed by --kv-eviction.", lambda s: s.kv.evicted_tokens),
    "kv_transfer_bytes": ("KV bytes pulled from prefill workers.", lambda s: s.transfer.bytes),
    "kv_transfer_blocks": ("KV blocks pulled from prefill workers.", lambda s: s.transfer.blocks),
    "kv_transfer_failures": ("KV pulls that failed.", lambda s: s.transfer.failures),
    "kv_lease_expired": ("KV leases that expired before decode pulled them.", lambda s: s.leases.expired),
    "structured_requests": ("Requests decoded under a grammar (structured outputs, required tool calls).",
                            lambda s: s.grammar.constrained_requests),
    "grammar_compiles": ("Grammars compiled (cache misses).", lambda s: s.grammar.compiles),
    "grammar_cache_hits": ("Grammar compile cache hits.", lambda s: s.grammar.cache_hits),
    "grammar_compile_seconds": ("Seconds spent compiling grammars (off the step loop).",
                                lambda s: s.grammar.compile_seconds),
    "grammar_mask_steps": ("Engine steps that masked logits with a grammar.", lambda s: s.grammar.mask_steps),
    "grammar_mask_seconds": ("Seconds spent computing and applying grammar masks inside steps "
                             "(divide by grammar_mask_steps for the time per step).",
                             lambda s: s.grammar.mask_seconds),
    "spec_decode_num_drafts": ("Number of spec decoding drafts.", lambda s: s.spec.num_drafts),
    "spec_decode_num_draft_tokens": ("Number of draft tokens.", lambda s: s.spec.num_draft_tokens),
    "spec_decode_num_accepted_tokens": ("Number of accepted tokens.", lambda s: s.spec.num_accepted_tokens),
}
TierGetter = Callable[[WorkerStats, KvTierStats], float]
TIER_GAUGES: dict[str, tuple[str, TierGetter]] = {
    "kv_cache_capacity_blocks": ("KV blocks the tier holds.", lambda s, t: t.capacity_blocks),
    "kv_cache_capacity_tokens": ("KV tokens the tier holds (blocks x block size).",
                                 lambda s, t: t.capacity_blocks * s.kv.block_size),
    "kv_cache_capacity_bytes": ("Bytes the tier's KV blocks take, scales included.",
                                lambda s, t: t.capacity_blocks * t.block_bytes),
    "kv_cache_used_blocks": ("KV blocks in use: held by requests (device) or stored (host, disk).",
                             lambda s, t: t.used_blocks),
}
TIER_COUNTERS: dict[str, tuple[str, TierGetter]] = {
    "kv_offload_hits": ("KV blocks restored from an offload tier on a prefix hit.", lambda s, t: t.hits),
}
HISTOGRAMS: dict[str, tuple[str, Callable[[WorkerStats], HistogramData | None]]] = {
    "request_queue_time_seconds": ("Seconds requests spent waiting in the worker's scheduler queue.",
                                   lambda s: s.requests.queue_time),
    "kv_transfer_seconds": ("Seconds per KV pull from a prefill worker.", lambda s: s.transfer.time),
    "kv_kept_fraction": ("Share of a finished request's tokens whose KV it still held (--kv-eviction).",
                         lambda s: s.kv.kept_fraction),
    "kv_head_budget_tokens": ("Each layer's KV head budget in tokens at a finished request's last eviction "
                              "(--kv-eviction headwise).", lambda s: s.kv.head_budget),
}


class ClusterCollector(Collector):
    """Families built from one scrape's worker stats and routing decision counts."""

    def __init__(self, stats: list[WorkerStats], decisions: Decisions) -> None:
        self.stats = stats
        self.decisions = decisions

    def collect(self) -> Iterator[Metric]:
        labels = ["worker", "role"]
        for name, (doc, get) in WORKER_GAUGES.items():
            g = GaugeMetricFamily(f"pdserve:worker_{name}", doc, labels=labels)
            for s in self.stats:
                g.add_metric([s.worker_id, s.role], get(s))
            yield g
        for name, (doc, get) in VLLM_GAUGES.items():
            g = GaugeMetricFamily(f"pdserve:{name}", doc, labels=labels)
            for s in self.stats:
                g.add_metric([s.worker_id, s.role], get(s))
            yield g
        for name, (doc, get) in COUNTERS.items():
            c = CounterMetricFamily(f"pdserve:{name}", doc, labels=labels)
            for s in self.stats:
                c.add_metric([s.worker_id, s.role], get(s))
            yield c
        c = CounterMetricFamily("pdserve:spec_decode_num_accepted_tokens_per_pos",
                                "Accepted tokens per draft (0-based) position.", labels=[*labels, "position"])
        for s in self.stats:
            for pos, n in enumerate(s.spec.accepted_per_pos):
                c.add_metric([s.worker_id, s.role, str(pos)], n)
        yield c
        tier_labels = [*labels, "tier", "kv_cache_dtype"]
        for name, (doc, tget) in TIER_GAUGES.items():
            g = GaugeMetricFamily(f"pdserve:{name}", doc, labels=tier_labels)
            for s, t in self._tiers():
                g.add_metric([s.worker_id, s.role, t.tier, s.kv.dtype], tget(s, t))
            yield g
        for name, (doc, tget) in TIER_COUNTERS.items():
            c = CounterMetricFamily(f"pdserve:{name}", doc, labels=tier_labels)
            for s, t in self._tiers():
                if t.tier != "device":
                    c.add_metric([s.worker_id, s.role, t.tier, s.kv.dtype], tget(s, t))
            yield c
        for name, (doc, hist) in HISTOGRAMS.items():
            h = HistogramMetricFamily(f"pdserve:{name}", doc, labels=labels)
            for s in self.stats:
                data = hist(s)
                if data is not None:
                    h.add_metric([s.worker_id, s.role], _buckets(data), data.sum)
            yield h
        d = CounterMetricFamily("pdserve:routing_decisions", "Routing decisions by role, policy and reason.",
                                labels=["role", "policy", "reason"])
        for (role, policy, reason), n in sorted(self.decisions.items()):
            d.add_metric([role, policy, reason], n)
        yield d

    def _tiers(self) -> Iterator[tuple[WorkerStats, KvTierStats]]:
        return ((s, t) for s in self.stats for t in s.kv.tiers)


def _buckets(data: HistogramData) -> list[tuple[str, float]]:
    out, total = [], 0
    for bound, n in zip([*data.bounds, float("inf")], data.counts, strict=True):
        total += n
        out.append(("+Inf" if bound == float("inf") else repr(float(bound)), float(total)))
    return out


def worker_metrics(stats: list[WorkerStats], decisions: Decisions | None = None) -> bytes:
    """Prometheus text for the workers' current stats and the routing decisions so far."""
    registry = CollectorRegistry()
    registry.register(ClusterCollector(stats, decisions or {}))
    return generate_latest(registry)

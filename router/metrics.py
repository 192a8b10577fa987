"""The router's Prometheus metrics, in a registry owned by one app (no process-global state)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from router.admission import AdmissionGate
from transfer.messages import WorkerStats

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class RouterMetrics:
    def __init__(self, gate: AdmissionGate) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("pdserve:router_requests", "HTTP requests answered, by endpoint and status.",
                                ["endpoint", "status"], registry=r)
        self.ttft = Histogram("pdserve:router_time_to_first_token_seconds",
                              "Seconds from admission to the first generated text of a request.",
                              ["endpoint"], buckets=TTFT_BUCKETS, registry=r)
        self.output_tokens = Counter("pdserve:router_output_tokens", "Generated tokens returned to clients.",
                                     registry=r)
        queued = Gauge("pdserve:router_queued_requests",
                       "Requests admitted and waiting for their first token.", registry=r)
        queued.set_function(lambda: gate.queued_requests)
        tokens = Gauge("pdserve:router_queued_prompt_tokens", "Prompt tokens of the queued requests.",
                       registry=r)
        tokens.set_function(lambda: gate.queued_tokens)
        flight = Gauge("pdserve:router_in_flight_requests", "Requests admitted and not yet answered in full.",
                       registry=r)
        flight.set_function(lambda: gate.in_flight)


WORKER_GAUGES = {
    "num_running": "Requests running on the worker.",
    "num_waiting": "Requests waiting on the worker.",
    "num_used_blocks": "KV blocks held by requests or leases on the worker.",
    "num_free_kv_blocks": "Free KV blocks on the worker.",
    "num_leases": "KV leases the worker holds for decode to pull.",
}


def worker_metrics(stats: list[WorkerStats]) -> bytes:
    """Prometheus text for the workers' current stats (``pdserve:worker_*{worker,role}``)."""
    registry = CollectorRegistry()
    for name, doc in WORKER_GAUGES.items():
        gauge = Gauge(f"pdserve:worker_{name}", doc, ["worker", "role"], registry=registry)
        for s in stats:
            gauge.labels(s.worker_id, s.role).set(getattr(s, name))
    return generate_latest(registry)

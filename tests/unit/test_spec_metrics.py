"""Speculative decoding's counters, from a worker's stats to the router's /metrics (vLLM's names)."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from messages.wire import KvStats, SpecDecodeStats, WorkerStats
from router.metrics import worker_metrics
from telemetry.histogram import FRACTION_BUCKETS, TOKEN_BUCKETS, Histogram


def test_spec_counters_and_per_position_acceptance() -> None:
    spec = SpecDecodeStats(num_drafts=5, num_draft_tokens=18, num_accepted_tokens=7,
                           accepted_per_pos=[4, 2, 1, 0])
    stats = WorkerStats(worker_id="decode-0", role="decode", kv=KvStats(num_blocks=8, free_blocks=8),
                        spec=spec)
    samples = {(s.name, s.labels.get("position")): s.value
               for f in text_string_to_metric_families(worker_metrics([stats]).decode()) for s in f.samples
               if s.name.startswith("pdserve:spec_decode")}
    expected: dict[tuple[str, str | None], float] = {
        ("pdserve:spec_decode_num_drafts_total", None): 5.0,
        ("pdserve:spec_decode_num_draft_tokens_total", None): 18.0,
        ("pdserve:spec_decode_num_accepted_tokens_total", None): 7.0,
        **{("pdserve:spec_decode_num_accepted_tokens_per_pos_total", str(i)): float(n)
           for i, n in enumerate([4, 2, 1, 0])},
    }
    assert samples == expected


def test_evicted_tokens_counter() -> None:
    stats = WorkerStats(worker_id="decode-0", role="decode",
                        kv=KvStats(num_blocks=8, free_blocks=8, evicted_tokens=48))
    samples = {s.name: s.value for f in text_string_to_metric_families(worker_metrics([stats]).decode())
               for s in f.samples if s.name.startswith("pdserve:kv_evicted")}
    assert samples == {"pdserve:kv_evicted_tokens_total": 48.0}


def test_eviction_histograms() -> None:
    """A worker under --kv-eviction headwise ships its finished requests' kept shares and head budgets;
    /metrics has them as Prometheus histograms (cumulative buckets), and neither without eviction."""
    kept, budgets = Histogram(FRACTION_BUCKETS), Histogram(TOKEN_BUCKETS)
    for share in (0.25, 0.5, 1.0):
        kept.observe(share)
    for budget in (16, 16, 48, 64):
        budgets.observe(budget)
    stats = WorkerStats(worker_id="decode-0", role="decode",
                        kv=KvStats(num_blocks=8, kept_fraction=kept.data(), head_budget=budgets.data()))
    samples = {(s.name, s.labels.get("le")): s.value
               for f in text_string_to_metric_families(worker_metrics([stats]).decode())
               for s in f.samples if s.name.startswith(("pdserve:kv_kept", "pdserve:kv_head"))}
    assert samples[("pdserve:kv_kept_fraction_bucket", "0.3")] == 1.0
    assert samples[("pdserve:kv_kept_fraction_bucket", "0.5")] == 2.0
    assert samples[("pdserve:kv_kept_fraction_count", None)] == 3.0
    assert samples[("pdserve:kv_kept_fraction_sum", None)] == 1.75
    assert samples[("pdserve:kv_head_budget_tokens_bucket", "16.0")] == 2.0
    assert samples[("pdserve:kv_head_budget_tokens_bucket", "64.0")] == 4.0
    assert samples[("pdserve:kv_head_budget_tokens_sum", None)] == 144.0
    plain = WorkerStats(worker_id="decode-0", role="decode", kv=KvStats(num_blocks=8))
    assert not [s for f in text_string_to_metric_families(worker_metrics([plain]).decode())
                for s in f.samples if s.name.startswith(("pdserve:kv_kept", "pdserve:kv_head"))]

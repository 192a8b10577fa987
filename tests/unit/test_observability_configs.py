"""deploy/observability parses, and every metric its dashboard queries is one /metrics exposes."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from messages.wire import KvStats, KvTierStats, RequestStats, TransferStats, WorkerStats
from router.admission import AdmissionGate
from router.metrics import RouterMetrics, worker_metrics
from telemetry.histogram import Histogram
from telemetry.tracing import TraceConfig

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "observability"
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"), "gauge": ("",)}


def exposed_names() -> set[str]:
    """Sample names of the router's registry plus the cluster families built from two workers' stats."""
    hist = Histogram()
    hist.observe(0.02)
    requests = RequestStats(running=1, queue_time=hist.data())
    tiers = [KvTierStats(tier="device", capacity_blocks=10, used_blocks=4, block_bytes=64),
             KvTierStats(tier="host", capacity_blocks=20, used_blocks=3, block_bytes=64, hits=2)]
    stats = [WorkerStats(worker_id="prefill-0", role="prefill", requests=requests,
                         kv=KvStats(num_blocks=10, free_blocks=6, used_blocks=4)),
             WorkerStats(worker_id="decode-0", role="decode", requests=requests,
                         transfer=TransferStats(time=hist.data()),
                         kv=KvStats(num_blocks=10, free_blocks=6, used_blocks=4, dtype="fp8", block_size=16,
                                    tiers=tiers, kept_fraction=hist.data(), head_budget=hist.data()))]
    text = generate_latest(RouterMetrics(AdmissionGate(8), "m").registry)
    text += worker_metrics(stats, {("decode", "prefix", "short"): 2})
    names = set()
    for fam in text_string_to_metric_families(text.decode()):
        names |= {fam.name + s for s in SUFFIXES.get(fam.type, ("",))}
        names |= {s.name for s in fam.samples}
    return names


def dashboard_metrics() -> set[str]:
    dash = json.loads((DEPLOY / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    assert len(exprs) >= 14
    return {m for e in exprs for m in re.findall(r"pdserve:[a-z0-9_:]+", e)}


def test_dashboard_queries_only_exposed_metrics() -> None:
    used = dashboard_metrics()
    assert used - exposed_names() == set()
    wanted = {"pdserve:time_to_first_token_seconds_bucket", "pdserve:inter_token_latency_seconds_bucket",
              "pdserve:kv_cache_usage_perc", "pdserve:prefix_cache_hits_total",
              "pdserve:kv_transfer_bytes_total", "pdserve:kv_transfer_failures_total",
              "pdserve:num_requests_waiting", "pdserve:num_preemptions_total",
              "pdserve:generation_tokens_total", "pdserve:kv_cache_capacity_tokens",
              "pdserve:kv_cache_used_blocks", "pdserve:kv_cache_capacity_blocks",
              "pdserve:kv_offload_hits_total", "pdserve:spec_decode_num_accepted_tokens_total",
              "pdserve:spec_decode_num_draft_tokens_total", "pdserve:spec_decode_num_drafts_total",
              "pdserve:spec_decode_num_accepted_tokens_per_pos_total"}
    assert wanted <= used


def test_worker_histogram_buckets_are_cumulative() -> None:
    hist = Histogram((0.1, 1.0))
    for v in (0.05, 0.5, 0.5, 3.0):
        hist.observe(v)
    stats = WorkerStats(worker_id="d", role="decode", kv=KvStats(num_blocks=1, free_blocks=1),
                        transfer=TransferStats(time=hist.data()))
    fams = {f.name: f for f in text_string_to_metric_families(worker_metrics([stats]).decode())}
    buckets = {s.labels["le"]: s.value for s in fams["pdserve:kv_transfer_seconds"].samples
               if s.name.endswith("_bucket")}
    assert buckets == {"0.1": 1.0, "1.0": 3.0, "+Inf": 4.0}


@pytest.mark.parametrize("name", sorted(p.name for p in DEPLOY.glob("*.y*ml")))
def test_yaml_configs_parse(name: str) -> None:
    assert isinstance(yaml.safe_load((DEPLOY / name).read_text()), dict)


def test_compose_mounts_existing_files() -> None:
    compose = yaml.safe_load((DEPLOY / "docker-compose.yaml").read_text())
    mounts = [v.split(":")[0] for s in compose["services"].values() for v in s.get("volumes", [])]
    assert mounts and all((DEPLOY / m).is_file() for m in mounts)
    scrape = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    assert scrape["scrape_configs"][0]["metrics_path"] == "/metrics"


def test_trace_config_from_env() -> None:
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318/", "OTEL_TRACES_SAMPLER_ARG": "0.25"}
    cfg = TraceConfig.from_env(env=env)
    assert (cfg.endpoint, cfg.protocol, cfg.sample_ratio) == ("http://collector:4318/v1/traces",
                                                              "http/protobuf", 0.25)
    grpc = TraceConfig.from_env(protocol="grpc", env=env)
    assert grpc.endpoint == "http://collector:4318"
    assert TraceConfig.from_env(env={}).endpoint is None
    assert TraceConfig.from_env("http://x/v1/traces", env=env).endpoint == "http://x/v1/traces"
    with pytest.raises(ValueError, match="protocol"):
        TraceConfig.from_env(protocol="thrift", env={})

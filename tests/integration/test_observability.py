"""One trace per request across router -> prefill -> KV transfer -> decode, exported over real OTLP/HTTP
from the session's default `pdserve serve` (the router and both worker processes) to a receiver in this
process; and a real Prometheus (Debian `prometheus`) scraping the server's /metrics answers a TTFT p50
query."""

from __future__ import annotations

import math
import os
import secrets
import shutil
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest

from tests.integration.conftest import _free_port
from tests.integration.otlp_receiver import OtlpReceiver, Span
from tests.waiting import wait_until

if TYPE_CHECKING:
    from tests.integration.conftest import PdserveServer

pytestmark = pytest.mark.slow

HOPS = ("router", "prefill.queue", "prefill.compute", "kv.transfer", "decode.queue", "decode")
STORY = ("The lighthouse keeper counted the ships that passed each night and wrote their names in a "
         "leather book, noting the wind, the tide and the colour of every sail. ")
TTFT_P50 = "histogram_quantile(0.5, sum by (le) (pdserve:time_to_first_token_seconds_bucket))"


@pytest.fixture(scope="module")
def receiver(otlp_receiver: OtlpReceiver) -> OtlpReceiver:
    return otlp_receiver


@pytest.fixture(scope="module")
def server(pdserve_server: PdserveServer) -> PdserveServer:
    return pdserve_server


@pytest.fixture(scope="module")
def model(server: PdserveServer) -> str:
    return str(httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"][0]["id"])


def chat(server: PdserveServer, content: str, max_tokens: int, headers: dict[str, str] | None = None,
         system: str | None = None) -> dict:
    model = httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"][0]["id"]
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": content})
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True}
    resp = httpx.post(f"{server.url}/v1/chat/completions", json=body, headers=headers or {}, timeout=120)
    assert resp.status_code == 200, resp.text
    return dict(resp.json())


def by_name(spans: list[Span]) -> dict[str, list[Span]]:
    out: dict[str, list[Span]] = {}
    for s in spans:
        out.setdefault(s.name, []).append(s)
    return out


def test_one_trace_covers_every_hop(server: PdserveServer, receiver: OtlpReceiver, model: str) -> None:
    trace_id, parent_id = secrets.token_hex(16), secrets.token_hex(8)
    # the server is shared: a system prompt of its own makes even the first block one no worker has cached
    body = chat(server, STORY * 4 + "How many ships?", 6, {"traceparent": f"00-{trace_id}-{parent_id}-01"},
                system=f"Log {trace_id}.")
    usage = body["usage"]
    assert usage["prompt_tokens"] >= 128
    receiver.wait(lambda: {s.name for s in receiver.trace(trace_id)} >= set(HOPS))
    spans = by_name(receiver.trace(trace_id))
    assert all(len(spans[h]) == 1 for h in HOPS), {h: len(spans[h]) for h in HOPS}
    router, pq, pc, kv, dq, dec = (spans[h][0] for h in HOPS)
    assert router.parent_id == parent_id
    assert {pq.parent_id, pc.parent_id, dq.parent_id, dec.parent_id} == {router.span_id}
    assert kv.parent_id == dq.span_id
    assert {s.service for s in (router, pq, kv)} == {"pdserve"}
    a = router.attrs
    assert a["gen_ai.operation.name"] == "chat" and a["gen_ai.request.model"] == model
    assert a["gen_ai.request.max_tokens"] == 6 and a["gen_ai.request.temperature"] == 0.0
    assert a["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    assert a["gen_ai.usage.output_tokens"] == usage["completion_tokens"] == 6
    assert a["gen_ai.usage.cache_read.input_tokens"] == usage["prompt_tokens_details"]["cached_tokens"]
    assert a["gen_ai.response.finish_reasons"] == ["length"]
    assert 0 < a["gen_ai.server.time_to_first_token"] < (router.end_ns - router.start_ns) / 1e9
    k = kv.attrs
    blocks = math.ceil(usage["prompt_tokens"] / 16)
    assert k["kv.outcome"] == "ok" and k["kv.attempt"] == 1 and k["kv.backend"] == "UCX"
    assert k["kv.blocks"] == blocks and k["kv.bytes"] == blocks * 16 * 23040 * 2  # float32: 2x bf16 bytes
    assert k["kv.descriptors"] > 0 and k["kv.duration_s"] > 0
    assert pc.attrs["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    assert dec.attrs["gen_ai.usage.output_tokens"] == 6
    assert router.start_ns <= pq.start_ns <= pq.end_ns <= pc.end_ns <= kv.start_ns <= kv.end_ns
    assert kv.end_ns <= dq.end_ns and abs(dq.end_ns - dec.start_ns) < 5e6 and dec.end_ns <= router.end_ns


def test_untraced_header_starts_a_new_root(server: PdserveServer, receiver: OtlpReceiver) -> None:
    before = {s.trace_id for s in receiver.spans if s.name == "router"}
    chat(server, "Say hi.", 2)
    receiver.wait(lambda: len({s.trace_id for s in receiver.spans if s.name == "router"} - before) == 1)
    (new,) = {s.trace_id for s in receiver.spans if s.name == "router"} - before
    roots = [s for s in receiver.trace(new) if s.name == "router"]
    assert roots[0].parent_id == ""


def _prometheus(server: PdserveServer, tmp: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = _free_port()
    target = server.url.removeprefix("http://")
    config = tmp / "prometheus.yml"
    config.write_text(f"global:\n  scrape_interval: 1s\nscrape_configs:\n  - job_name: pdserve\n"
                      f"    static_configs:\n      - targets: ['{target}']\n")
    cmd = [shutil.which("prometheus") or "prometheus", f"--config.file={config}",
           f"--storage.tsdb.path={tmp / 'data'}", f"--web.listen-address=127.0.0.1:{port}"]
    log = (tmp / "prometheus.log").open("wb")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), f"http://127.0.0.1:{port}"


def test_prometheus_scrapes_ttft(server: PdserveServer, tmp_path: Path) -> None:
    if shutil.which("prometheus") is None and not os.path.exists("/usr/bin/prometheus"):
        pytest.skip("the Prometheus server binary is absent (apt-get install prometheus; "
                    "scripts/setup.sh --test installs it)")
    for i in range(3):
        chat(server, f"Count to {i + 3}.", 4)
    proc, url = _prometheus(server, tmp_path)
    try:
        def ttft_p50() -> str | None:
            assert proc.poll() is None, (tmp_path / "prometheus.log").read_text()[-2000:]
            try:
                resp = httpx.get(f"{url}/api/v1/query", params={"query": TTFT_P50}, timeout=5)
            except httpx.HTTPError:
                return None
            # while it starts, Prometheus answers in plain text ("Service Unavailable")
            result = resp.json()["data"]["result"] if resp.status_code == 200 else []
            answer = result[0]["value"][1] if result else None
            return None if answer in ("NaN", "+Inf") else answer

        value = float(wait_until(ttft_p50, 60, "Prometheus answering a TTFT p50", interval=0.5))
        assert 0 < value < 120
        up = httpx.get(f"{url}/api/v1/query", params={"query": "pdserve:kv_cache_usage_perc"}, timeout=5)
        roles = {r["metric"]["role"] for r in up.json()["data"]["result"]}
        assert roles == {"prefill", "decode"}
    finally:
        proc.terminate()
        proc.wait(20)


Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(server: PdserveServer) -> Samples:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    return {(s.name, frozenset(s.labels.items())): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def total(samples: Samples, name: str, **labels: str) -> float:
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)


def test_vllm_named_metrics_count_one_request(server: PdserveServer) -> None:
    before = scrape(server)
    usage = chat(server, STORY * 3 + "Which wind?", 5)["usage"]

    def settled() -> Samples | None:
        """A scrape once the workers' stats, which the router refreshes every 0.1 s, show the request
        done: its transfer and its prefill queue time counted, nothing running, no decode block held."""
        now = scrape(server)
        done = (total(now, "pdserve:kv_transfer_seconds_count", role="decode")
                > total(before, "pdserve:kv_transfer_seconds_count", role="decode")
                and total(now, "pdserve:request_queue_time_seconds_count", role="prefill")
                > total(before, "pdserve:request_queue_time_seconds_count", role="prefill")
                and total(now, "pdserve:num_requests_running") == 0
                and total(now, "pdserve:kv_cache_usage_perc", role="decode") == 0)
        return now if done else None

    after = wait_until(settled, 30, "the workers' stats showing the request done")

    def delta(name: str, **labels: str) -> float:
        return total(after, name, **labels) - total(before, name, **labels)

    blocks = math.ceil(usage["prompt_tokens"] / 16)
    assert delta("pdserve:generation_tokens_total") == 5
    assert delta("pdserve:prompt_tokens_total") == usage["prompt_tokens"]
    assert delta("pdserve:time_to_first_token_seconds_count") == 1
    assert delta("pdserve:e2e_request_latency_seconds_count") == 1
    moved = delta("pdserve:kv_transfer_blocks_total", role="decode", worker="decode-0")
    assert 1 <= moved <= blocks  # only the blocks the decode worker's prefix cache lacks
    assert delta("pdserve:kv_transfer_bytes_total", role="decode", worker="decode-0") == moved * 16 * 46080
    assert delta("pdserve:kv_transfer_seconds_count", role="decode") == 1
    assert delta("pdserve:request_queue_time_seconds_count", role="prefill") == 1
    assert delta("pdserve:routing_decisions_total", role="prefill", policy="prefix") == 1
    assert total(after, "pdserve:kv_transfer_failures_total") == 0

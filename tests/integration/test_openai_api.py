"""The OpenAI API over real HTTP against `pdserve serve` (1 prefill, 1 decode), via the openai client."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.sampling import SamplingParams
from tests.waiting import wait_until

if TYPE_CHECKING:
    from tests.integration.conftest import PdserveServer

pytestmark = pytest.mark.slow

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
COLORS = "The three primary colors are"


@pytest.fixture(scope="module")
def client(pdserve_server: PdserveServer) -> Any:
    return openai.OpenAI(base_url=f"{pdserve_server.url}/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(client: Any) -> str:
    return client.models.list().data[0].id


def metric(server: PdserveServer, name: str, **labels: str) -> float:
    """Sum of every sample of ``name`` in /metrics whose labels include ``labels``."""
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == name and labels.items() <= s.labels.items())


def wait_idle(server: PdserveServer, timeout: float = 20.0) -> None:
    """Until the router holds no request and no worker runs one or holds a KV block."""
    names = ("pdserve:router_in_flight_requests", "pdserve:router_queued_requests",
             "pdserve:worker_num_running", "pdserve:worker_num_used_blocks", "pdserve:worker_num_leases")
    assert metric(server, "pdserve:worker_num_free_kv_blocks") > 0  # the workers' stats are exported

    def busy() -> dict[str, float]:
        return {n: value for n in names if (value := metric(server, n))}

    wait_until(lambda: not busy(), timeout, "the server idle", 0.2, busy)


def test_models_and_health(pdserve_server: PdserveServer, client: Any) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == ["SmolLM2-135M-Instruct.Q4_1"]
    assert models[0].object == "model"
    assert httpx.get(f"{pdserve_server.url}/health").status_code == 200
    schema = httpx.get(f"{pdserve_server.url}/openapi.json").json()
    assert "/v1/chat/completions" in schema["paths"]
    assert "ChatCompletionRequest" in schema["components"]["schemas"]


def test_chat_greedy_equals_engine(client: Any, model: str) -> None:
    from engine import LLM

    llm = LLM(dtype="float32", kv_cache_memory=64 * 2**20)
    expected = llm.chat(FRANCE, SamplingParams(max_tokens=24, temperature=0.0))[0]
    raw = llm.generate(COLORS, SamplingParams(max_tokens=24, temperature=0.0))[0]
    got = client.chat.completions.create(model=model, messages=FRANCE, max_tokens=24, temperature=0)
    assert got.choices[0].message.content == expected.text
    assert got.choices[0].message.role == "assistant"
    assert got.usage is not None and got.usage.completion_tokens == len(expected.token_ids)
    assert got.usage.prompt_tokens == expected.metrics.prompt_tokens
    done = client.completions.create(model=model, prompt=COLORS, max_tokens=24, temperature=0)
    assert done.choices[0].text == raw.text
    assert done.choices[0].finish_reason == raw.finish_reason
    ids = llm.tokenizer.encode(COLORS)
    by_ids = client.completions.create(model=model, prompt=ids, max_tokens=24, temperature=0)
    assert by_ids.choices[0].text == raw.text
    batch = client.completions.create(model=model, prompt=[ids, ids[:3]], max_tokens=5, temperature=0)
    assert [c.index for c in batch.choices] == [0, 1]
    assert batch.choices[0].text == client.completions.create(
        model=model, prompt=ids, max_tokens=5, temperature=0).choices[0].text


def test_chat_streaming_matches_non_streaming(client: Any, model: str) -> None:
    full = client.chat.completions.create(model=model, messages=FRANCE, max_tokens=20, temperature=0)
    chunks = list(client.chat.completions.create(
        model=model, messages=FRANCE, max_tokens=20, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[0].finish_reason
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert last.usage.completion_tokens == full.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_completions_streaming_n2(client: Any, model: str) -> None:
    stream = client.completions.create(model=model, prompt=COLORS, max_tokens=12, temperature=0, n=2,
                                       stream=True)
    texts = ["", ""]
    finish: list[str | None] = [None, None]
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.text
            finish[c.index] = c.finish_reason or finish[c.index]
    assert texts[0] == texts[1] != ""
    assert finish == ["length", "length"]


def test_seed_reproducible_and_n_distinct(client: Any, model: str) -> None:
    def sample(seed: int, n: int = 1) -> list[str]:
        out = client.completions.create(model=model, prompt=COLORS, max_tokens=16, temperature=0.8,
                                        seed=seed, n=n)
        return [c.text for c in sorted(out.choices, key=lambda c: c.index)]

    assert sample(1234) == sample(1234)
    pair = sample(1234, n=2)
    assert pair[0] == sample(1234)[0]  # choice i uses seed + i
    assert pair[1] == sample(1235)[0]


def test_stop_strings(client: Any, model: str) -> None:
    base = client.completions.create(model=model, prompt=COLORS, max_tokens=24, temperature=0, logprobs=0)
    text = base.choices[0].text
    tokens = base.choices[0].logprobs.tokens
    assert "".join(tokens) == text
    i = next(k for k in range(2, len(tokens) - 1) if len(tokens[k]) >= 3 and len(tokens[k + 1]) >= 2)
    split = tokens[i][-2:] + tokens[i + 1][:2]  # spans a token boundary
    word = tokens[i].strip()
    for stop in (split, [word, "zzzz"]):
        first = min(text.find(s) for s in ([stop] if isinstance(stop, str) else stop) if s in text)
        got = client.completions.create(model=model, prompt=COLORS, max_tokens=24, temperature=0, stop=stop)
        assert got.choices[0].text == text[:first]
        assert got.choices[0].finish_reason == "stop"
        streamed = client.completions.create(model=model, prompt=COLORS, max_tokens=24, temperature=0,
                                             stop=stop, stream=True)
        assert "".join(c.choices[0].text for c in streamed if c.choices) == text[:first]


def test_logprobs(client: Any, model: str) -> None:
    chat = client.chat.completions.create(model=model, messages=FRANCE, max_tokens=6, temperature=0,
                                          logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert content is not None and len(content) == chat.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.logprob <= 0 and entry.top_logprobs[0].logprob >= entry.top_logprobs[-1].logprob
        assert abs(entry.top_logprobs[0].logprob - entry.logprob) < 1e-4  # greedy picks the top token
    comp = client.completions.create(model=model, prompt=COLORS, max_tokens=6, temperature=0, logprobs=2)
    lp = comp.choices[0].logprobs
    assert lp is not None and len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:k]) for k in range(6)]
    assert all(len(t) == 2 for t in lp.top_logprobs)


def _sse(lines: Iterator[str]) -> Iterator[dict[str, Any]]:
    for line in lines:
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line[6:])


def decoded_tokens(server: PdserveServer) -> int:
    """Tokens the decode workers' steps have computed so far (``WorkerStats.clock.decode_rows``)."""
    workers = httpx.get(f"{server.url}/v1/workers", timeout=10).json()["workers"]
    return sum(int(w["clock"]["decode_rows"]) for w in workers if w["role"] == "decode")


def test_client_disconnect_aborts_backend(pdserve_server: PdserveServer, model: str) -> None:
    """A client that leaves after five events stops its request on the workers: told by the tokens they
    decoded for it (a few, not the 2000 asked for), however long the abort takes to land."""
    answered = "pdserve:router_requests_total"
    completed = ("pdserve:router_output_tokens_total", "pdserve:e2e_request_latency_seconds_count")
    wait_idle(pdserve_server)
    before = metric(pdserve_server, answered, endpoint="/v1/completions")
    done_before = [metric(pdserve_server, n) for n in completed]
    decoded_before = decoded_tokens(pdserve_server)
    body = {"model": model, "prompt": COLORS, "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as http, \
            http.stream("POST", f"{pdserve_server.url}/v1/completions", json=body) as resp:
        assert resp.status_code == 200
        for got, _ in enumerate(_sse(resp.iter_lines()), 1):
            if got == 5:
                break
    wait_idle(pdserve_server, timeout=120)  # the abort landed, or all 2000 tokens were decoded
    assert decoded_tokens(pdserve_server) - decoded_before < 1000  # stopped when the client left
    wait_until(lambda: metric(pdserve_server, answered, endpoint="/v1/completions") == before + 1, 30,
               "the abandoned request counted once", 0.1,
               lambda: metric(pdserve_server, answered, endpoint="/v1/completions") - before)
    # an abandoned stream is not a completed request: no output tokens or latency recorded for it
    assert [metric(pdserve_server, n) for n in completed] == done_before


def test_wire_format_and_idle_after(pdserve_server: PdserveServer, model: str) -> None:
    body = {"model": model, "messages": FRANCE, "max_tokens": 4, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{pdserve_server.url}/v1/chat/completions", json=body, timeout=60) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        raw = resp.read().decode()
    events = raw.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    assert all(e.startswith("data: ") for e in events[:-1])
    last = json.loads(events[-3][6:])
    assert last["choices"] == [] and last["usage"]["total_tokens"] > 0
    assert "cached_tokens" in last["usage"]["prompt_tokens_details"]
    wait_idle(pdserve_server)

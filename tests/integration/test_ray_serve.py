"""The Ray Serve application (``cli.serve_app:build_app``) on the test session's Ray instance.

Serve's HTTP proxy runs on a free port; the official ``openai`` client talks to
the router through it (a chat completion, a streamed one whose first chunk
arrives while the decode worker is still generating, an OpenAI-shaped error),
``/health`` and ``/metrics`` answer; deleting the application leaves no worker
actor and no placement group behind. Serve is shut down at the end so the Ray
session stays as the other modules expect it.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from tests.integration.conftest import _free_port

pytestmark = pytest.mark.slow

APP = "pdserve"
WORKER_NAME = re.compile(r"^pdserve-[0-9a-f]{6}-(prefill|decode)-\d+$")
PROMPT: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Name three colours."}]


def _workers() -> set[str]:
    """Names of the live pdserve worker actors in any namespace (Serve's replicas create them in its own)."""
    import ray

    actors = ray.util.list_named_actors(all_namespaces=True)
    return {a["name"] for a in actors if WORKER_NAME.match(a["name"])}


def _groups(names: set[str]) -> dict[str, str]:
    """Placement group name -> state, for the groups named after ``names``."""
    import ray

    return {g["name"]: g["state"] for g in ray.util.placement_group_table().values() if g["name"] in names}


@pytest.fixture(scope="module")
def others(ray_session: None) -> set[str]:
    """Workers already on the session's Ray (other servers') before the application starts."""
    return _workers()


@pytest.fixture(scope="module")
def serve_url(others: set[str], default_model_path: Path) -> Iterator[str]:
    from ray import serve

    from cli.serve_app import build_app

    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        app = build_app({"model": str(default_model_path), "num-prefill": 1, "num-decode": 1,
                         "worker-cpus": 0.5, "torch-threads": 1, "kv-cache-memory": "256M",
                         "linear-kernel": "plain", "routing": "prefix"})
        serve.run(app, name=APP, route_prefix="/")  # returns once the replica (and the workers) is up
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()


@pytest.fixture(scope="module")
def client(serve_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{serve_url}/v1", api_key="unused", timeout=120, max_retries=0)


def test_health_and_metrics(serve_url: str) -> None:
    assert httpx.get(f"{serve_url}/health", timeout=30).status_code == 200
    metrics = httpx.get(f"{serve_url}/metrics", timeout=30)
    assert metrics.status_code == 200
    assert 'pdserve:num_requests_running{' in metrics.text and 'role="decode"' in metrics.text


def test_chat_completion_and_stream_match(client: openai.OpenAI, serve_url: str) -> None:
    model = client.models.list().data[0].id
    extra: dict[str, Any] = {"ignore_eos": True}
    full = client.chat.completions.create(model=model, messages=PROMPT, max_tokens=12, temperature=0,
                                          extra_body=extra)
    assert full.usage is not None and full.usage.completion_tokens == 12
    text = full.choices[0].message.content
    assert text

    stream = client.chat.completions.create(model=model, messages=PROMPT, max_tokens=12, temperature=0,
                                            stream=True, extra_body=extra)
    pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert len([p for p in pieces if p]) >= 3
    assert "".join(pieces) == text


def test_stream_arrives_while_generating(client: openai.OpenAI, serve_url: str) -> None:
    """The proxy forwards chunks as they come: after the first one the decode worker is still running it."""
    model = client.models.list().data[0].id
    stream = client.chat.completions.create(model=model, messages=PROMPT, max_tokens=96, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True})
    chunks = iter(stream)
    first = next(c for c in chunks if c.choices and c.choices[0].delta.content)
    assert first.choices[0].delta.content
    rows = httpx.get(f"{serve_url}/v1/workers", timeout=30).json()["workers"]
    decode = [w for w in rows if w["role"] == "decode"]
    assert [w["requests"]["running"] for w in decode] == [1], rows
    rest = [c for c in chunks if c.choices]
    assert rest[-1].choices[0].finish_reason == "length"


def test_errors_keep_their_shape(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="no-such-model", messages=PROMPT,
                                       max_tokens=2)
    assert missing.value.status_code == 404
    model = client.models.list().data[0].id
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=model, messages=PROMPT, max_tokens=2,
                                       temperature=-1)
    assert bad.value.status_code == 400 and "temperature" in str(bad.value)


def test_delete_leaves_no_workers(serve_url: str, others: set[str]) -> None:
    from ray import serve

    names = _workers() - others
    assert len(names) == 2 and {n.rsplit("-", 2)[1] for n in names} == {"prefill", "decode"}, names
    assert set(_groups(names).values()) == {"CREATED"}
    serve.delete(APP)
    deadline = time.monotonic() + 30
    while (names & _workers() or set(_groups(names).values()) != {"REMOVED"}) \
            and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not names & _workers()
    assert _groups(names) == dict.fromkeys(names, "REMOVED")
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{serve_url}/health", timeout=5).raise_for_status()

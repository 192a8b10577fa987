"""Greedy constrained output does not depend on where it was computed: the shared disaggregated server
(prefill samples the first token under the grammar, decode rebuilds the grammar's state from it) and a
colocated server (no prefill workers, two decode workers) give the same text, and so does a stream whose
decode worker is killed mid-way (the continuation replays the streamed tokens into the grammar on the
other decode worker). One extra server for the module.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import httpx
import jsonschema
import pytest

if TYPE_CHECKING:
    from tests.integration.conftest import PdserveServer

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct.Q4_1"
SCHEMA = {"type": "object", "properties": {
    "planets": {"type": "array", "items": {"type": "string", "maxLength": 10}, "minItems": 5, "maxItems": 5},
    "count": {"type": "integer"}}, "required": ["planets", "count"], "additionalProperties": False}
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "List five planets as JSON."}],
        "temperature": 0, "max_tokens": 80,
        "response_format": {"type": "json_schema", "json_schema": {"name": "planets", "schema": SCHEMA}}}
HEADER = "x-pdserve-decode-worker"


@pytest.fixture(scope="module")
def colocated(pdserve_factory: Callable[..., PdserveServer]) -> PdserveServer:
    return pdserve_factory("--num-prefill", "0", "--num-decode", "2", "--routing", "round-robin",
                           "--migration-limit", "1")


def complete(server: PdserveServer) -> str:
    resp = httpx.post(f"{server.url}/v1/chat/completions", json=BODY, timeout=180)
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    return str(choice["message"]["content"])


def test_same_output_disaggregated_colocated_and_migrated(pdserve_server: PdserveServer,
                                                          colocated: PdserveServer) -> None:
    disaggregated = complete(pdserve_server)
    jsonschema.validate(json.loads(disaggregated), SCHEMA)
    assert complete(colocated) == disaggregated
    pieces: list[str] = []
    finish: list[str] = []
    killed = False
    url = f"{colocated.url}/v1/chat/completions"
    with httpx.Client(timeout=180) as http, http.stream("POST", url, json={**BODY, "stream": True}) as resp:
        assert resp.status_code == 200
        victim = resp.headers[HEADER]
        for n, line in enumerate((ln for ln in resp.iter_lines() if ln.startswith("data: {")), 1):
            event: dict[str, Any] = json.loads(line[6:])
            for c in event["choices"]:
                pieces.append(c["delta"].get("content") or "")
                if c["finish_reason"]:
                    finish.append(c["finish_reason"])
            if n == 4:
                assert not finish, "the stream ended before the kill"
                workers = httpx.get(f"{colocated.url}/v1/workers", timeout=10).json()["workers"]
                os.kill(next(w["pid"] for w in workers if w["worker_id"] == victim), signal.SIGKILL)
                killed = True
    assert killed and finish == ["stop"]
    assert "".join(pieces) == disaggregated

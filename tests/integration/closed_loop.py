"""Closed-loop streaming chat load over real HTTP, and the admin reads the drain and planner tests share.

``Load`` runs up to ``clients`` streaming clients in a thread of their own; ``target`` of them send at
a time (a test raises or lowers it while the load runs). Each request is one ``Record``: the decode
worker that served it (the ``x-pdserve-decode-worker`` header), its status, time to first token, text,
finish reason and completion tokens (from the usage chunk).
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import httpx
import pytest

if TYPE_CHECKING:
    from tests.integration.conftest import PdserveServer

CHAT = "/v1/chat/completions"
HEADER = "x-pdserve-decode-worker"


def chat_body(model: str, prompt: str, max_tokens: int, stream: bool) -> dict[str, Any]:
    """A greedy chat request of exactly ``max_tokens`` output tokens."""
    return {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": stream,
            **({"stream_options": {"include_usage": True}} if stream else {})}


def workers(server: PdserveServer, auth: dict[str, str]) -> dict[str, Any]:
    resp = httpx.get(f"{server.url}/v1/workers", headers=auth, timeout=10)
    assert resp.status_code == 200, resp.text
    return dict(resp.json())


def decode_ids(server: PdserveServer, auth: dict[str, str]) -> tuple[list[str], list[str]]:
    """(decode workers routed to, workers draining)."""
    w = workers(server, auth)
    draining = list(w["draining"])
    return sorted(s["worker_id"] for s in w["workers"] if s["role"] == "decode" and
                  s["worker_id"] not in draining), draining


def wait_for(what: str, check: Callable[[], bool], timeout: float,
             server: PdserveServer | None = None) -> float:
    """Poll ``check`` every 0.25 s; fail the test past ``timeout``. The time it first held."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            tail = server.log_tail(60) if server is not None else ""
            pytest.fail(f"not within {timeout:.0f} s: {what}\n{tail}")
        time.sleep(0.25)
    return time.monotonic()


def metric(server: PdserveServer, auth: dict[str, str], name: str, **labels: str) -> float:
    """The sum of a Prometheus series' samples whose labels include ``labels``."""
    text = httpx.get(f"{server.url}/metrics", headers=auth, timeout=10).text
    total = 0.0
    for line in text.splitlines():
        m = re.match(rf"^{re.escape(name)}\{{(.*)\}} (\S+)$", line)
        if m and all(f'{k}="{v}"' in m.group(1) for k, v in labels.items()):
            total += float(m.group(2))
    return total


def p90(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[max(0, -(-9 * len(ordered) // 10) - 1)]


@dataclass
class Record:
    prompt: int
    started: float
    status: int = 0
    worker: str = ""
    ttft: float | None = None
    ended: float | None = None
    text: str = ""
    finish: str | None = None
    tokens: int = 0
    pieces: int = 0  # content deltas received so far

    @property
    def itl(self) -> float | None:
        """Seconds per output token after the first."""
        if self.ttft is None or self.ended is None or self.tokens < 2:
            return None
        return (self.ended - self.started - self.ttft) / (self.tokens - 1)


@dataclass
class Load:
    url: str
    auth: dict[str, str]
    prompts: list[str]
    body: Callable[[str], dict[str, Any]]  # a prompt's streaming request body
    clients: int
    references: list[str]  # each prompt's text when it runs alone
    target: int = 0
    records: list[Record] = field(default_factory=list)
    stop: bool = False
    thread: threading.Thread | None = None

    def start(self, n: int) -> None:
        self.target = n
        self.thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.stop = True
        if self.thread is not None:
            self.thread.join(120)
            assert not self.thread.is_alive(), "the load did not stop"

    def since(self, t: float) -> list[Record]:
        """The requests sent at or after ``t`` that have ended."""
        return [r for r in list(self.records) if r.started >= t and r.ended is not None]

    def running(self, worker: str, before_piece: int) -> list[Record]:
        """The requests ``worker`` is streaming now, fewer than ``before_piece`` content deltas in."""
        return [r for r in list(self.records)
                if r.worker == worker and r.ttft is not None and r.ended is None and r.pieces < before_piece]

    async def _main(self) -> None:
        async with httpx.AsyncClient(headers=self.auth, timeout=180) as http:
            await asyncio.gather(*[self._client(http, j) for j in range(self.clients)])

    async def _client(self, http: httpx.AsyncClient, j: int) -> None:
        n = 0
        while not self.stop:
            if j >= self.target:
                await asyncio.sleep(0.05)
                continue
            rec = Record((j + n) % len(self.prompts), time.monotonic())
            n += 1
            self.records.append(rec)
            body = self.body(self.prompts[rec.prompt])
            async with http.stream("POST", f"{self.url}{CHAT}", json=body) as resp:
                rec.status, rec.worker = resp.status_code, resp.headers.get(HEADER, "")
                async for line in resp.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    event = json.loads(line[6:])
                    for c in event["choices"]:
                        if c["delta"].get("content") and rec.ttft is None:
                            rec.ttft = time.monotonic() - rec.started
                        rec.text += c["delta"].get("content") or ""
                        rec.pieces += bool(c["delta"].get("content"))
                        rec.finish = c["finish_reason"] or rec.finish
                    rec.tokens = (event.get("usage") or {}).get("completion_tokens", rec.tokens)
            rec.ended = time.monotonic()


def references(server: PdserveServer, auth: dict[str, str], prompts: list[str],
               body: Callable[[str], dict[str, Any]]) -> list[str]:
    """Each prompt's text when it runs alone (non-streamed): what every loaded request must match."""
    texts = []
    for prompt in prompts:
        resp = httpx.post(f"{server.url}{CHAT}", headers=auth, json=body(prompt), timeout=120)
        assert resp.status_code == 200, resp.text
        texts.append(resp.json()["choices"][0]["message"]["content"])
    return texts


def lost_or_disturbed(load: Load, max_tokens: int) -> list[tuple[Any, ...]]:
    """Every request that did not end 200, at ``max_tokens`` tokens, with its prompt's reference text."""
    refs = load.references
    return [(r.prompt, r.status, r.finish, r.tokens, r.text == refs[r.prompt]) for r in load.records
            if (r.status, r.finish, r.tokens, r.text) != (200, "length", max_tokens, refs[r.prompt])]


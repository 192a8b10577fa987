"""The load generator: streams workload sessions at an OpenAI-compatible server with asyncio + httpx.

``run_bench`` sends sessions either open-loop (``rate``: sessions start at Poisson
arrival times, seeded) or closed-loop (``concurrency``: that many sessions in
flight, each starting when one ends) for ``duration`` seconds; requests still
running then get ``drain_timeout`` more seconds, after which they are cancelled
and recorded as ``cancelled``. Every request streams (``stream_options.include_usage``)
so TTFT and the gaps between chunks are measured at the client; output tokens come
from the final usage chunk (or, without one, from counting the text with the tokenizer).

While it runs, a sampler reads the server's ``/metrics`` (and, on pdserve,
``/v1/workers``) every ``metrics_interval`` seconds: KV usage, queue depth and the
KV memory utilisation (tokens stored / token slots of the held blocks).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TextIO

import httpx

from bench.stats import RequestRecord
from bench.workloads import Session

# /metrics names read for KV usage and queue depth, first found wins (current and vLLM-style pdserve names,
# and vLLM's own).
KV_USAGE_NAMES = ("pdserve:kv_cache_usage_perc", "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
QUEUE_NAMES = ("pdserve:num_requests_waiting", "pdserve:router_queued_requests", "vllm:num_requests_waiting")
RUNNING_NAMES = ("pdserve:num_requests_running", "pdserve:router_in_flight_requests",
                 "vllm:num_requests_running")
FAILURE_PAUSE = 0.05


@dataclass
class BenchConfig:
    url: str
    model: str
    duration: float
    rate: float | None = None
    concurrency: int | None = None
    api_key: str | None = None
    seed: int = 0
    ignore_eos: bool = True
    temperature: float = 0.0
    request_timeout: float = 600.0
    drain_timeout: float = 60.0
    metrics_interval: float = 1.0
    progress: bool = True


@dataclass
class RunResult:
    records: list[RequestRecord]
    duration: float
    samples: list[dict[str, float]] = field(default_factory=list)


def parse_prometheus(text: str) -> dict[str, float]:
    """Sum of every sample of each metric name in Prometheus text (labels dropped)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if "{" in line:
            name, rest = line.split("{", 1)[0], line[line.rfind("}") + 1:]
        else:
            name, _, rest = line.partition(" ")
        fields = rest.split()
        try:
            value = float(fields[0])
        except (IndexError, ValueError):
            continue
        out[name.strip()] = out.get(name.strip(), 0.0) + value
    return out


def metrics_sample(metrics: dict[str, float]) -> dict[str, float]:
    """KV usage (0-1), queue depth and running requests from parsed /metrics, defensively by name."""
    sample: dict[str, float] = {}
    for name in KV_USAGE_NAMES:
        if name in metrics:
            value = metrics[name]
            sample["kv_usage"] = value / 100.0 if value > 1.0 else value
            break
    else:
        used = metrics.get("pdserve:worker_num_used_blocks")
        free = metrics.get("pdserve:worker_num_free_kv_blocks")
        if used is not None and free is not None and used + free > 0:
            sample["kv_usage"] = used / (used + free)
    for key, names in (("queue_depth", QUEUE_NAMES), ("running", RUNNING_NAMES)):
        for name in names:
            if name in metrics:
                sample[key] = metrics[name]
                break
    return sample


def workers_sample(payload: Any) -> dict[str, float]:
    """KV memory utilisation and token counts from pdserve's ``/v1/workers`` JSON."""
    workers = payload.get("workers", []) if isinstance(payload, dict) else []
    kvs = [w.get("kv", {}) for w in workers]
    stored = sum(int(kv.get("stored_tokens", 0)) for kv in kvs)
    slots = sum(int(kv.get("used_blocks", 0)) * int(kv.get("block_size", 0)) for kv in kvs)
    if not kvs or not any("block_size" in kv for kv in kvs):
        return {}
    out = {"kv_stored_tokens": float(stored), "kv_token_slots": float(slots)}
    if slots > 0:
        out["kv_utilisation"] = stored / slots
    return out


class Progress:
    """A one-line progress bar on stderr (redrawn in place when it is a terminal)."""

    def __init__(self, total: float, stream: TextIO = sys.stderr, enabled: bool = True) -> None:
        self.total, self.stream, self.enabled = total, stream, enabled
        self.tty = stream.isatty()
        self.last = -1.0

    def update(self, elapsed: float, done: int, failed: int, in_flight: int, force: bool = False) -> None:
        if not self.enabled or (not force and not self.tty and elapsed - self.last < 10):
            return
        self.last = elapsed
        frac = min(1.0, elapsed / self.total) if self.total > 0 else 1.0
        bar = "#" * int(frac * 30)
        line = (f"[{bar:<30}] {min(elapsed, self.total):6.1f}/{self.total:.0f} s  done {done}  "
                f"failed {failed}  in flight {in_flight}")
        self.stream.write(("\r" + line) if self.tty else line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled and self.tty:
            self.stream.write("\n")
            self.stream.flush()


def headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def first_model(client: httpx.AsyncClient, url: str, api_key: str | None) -> dict[str, Any]:
    """The first model card of ``GET /v1/models``; RuntimeError when there is none."""
    resp = await client.get(f"{url}/v1/models", headers=headers(api_key))
    if resp.status_code != 200:
        raise RuntimeError(f"GET {url}/v1/models answered {resp.status_code}: {resp.text[:200]}")
    data = resp.json().get("data") or []
    if not data:
        raise RuntimeError(f"GET {url}/v1/models lists no model")
    card: dict[str, Any] = data[0]
    return card


def _chunk_text(obj: dict[str, Any]) -> str:
    choices = obj.get("choices") or []
    if not choices:
        return ""
    c = choices[0]
    if "delta" in c:
        return str((c.get("delta") or {}).get("content") or "")
    return str(c.get("text") or "")


async def send(client: httpx.AsyncClient, cfg: BenchConfig, session: Session, turn: int,
               answers: list[str], record: RequestRecord, count_tokens: Callable[[str], int]) -> str:
    """Stream one request, filling ``record``; returns the generated text."""
    t = session.turns[turn]
    body: dict[str, Any] = {"model": cfg.model, "max_tokens": t.max_tokens, "stream": True,
                            "stream_options": {"include_usage": True}, "temperature": cfg.temperature}
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    if session.kind == "chat":
        path = "/v1/chat/completions"
        body["messages"] = session.messages(turn, answers)
    else:
        path = "/v1/completions"
        body["prompt"] = t.text
    pieces: list[str] = []
    usage: dict[str, Any] | None = None
    last = record.start
    async with client.stream("POST", f"{cfg.url}{path}", json=body, headers=headers(cfg.api_key),
                             timeout=cfg.request_timeout) as resp:
        if resp.status_code != 200:
            record.status = str(resp.status_code)
            record.error = (await resp.aread()).decode(errors="replace")[:300]
            return ""
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            obj = json.loads(data)
            if obj.get("error"):
                record.status, record.error = "stream_error", str(obj["error"])[:300]
                return "".join(pieces)
            if obj.get("usage"):
                usage = obj["usage"]
            text = _chunk_text(obj)
            if text:
                now = time.perf_counter()
                if record.ttft is None:
                    record.ttft = now - record.start
                else:
                    record.chunk_gaps.append(now - last)
                last = now
                pieces.append(text)
    record.e2e = time.perf_counter() - record.start
    answer = "".join(pieces)
    if usage:
        record.output_tokens = int(usage.get("completion_tokens") or 0)
        record.prompt_tokens = int(usage.get("prompt_tokens") or 0)
    else:
        record.output_tokens = count_tokens(answer)
    if not record.prompt_tokens:
        record.prompt_tokens = session.system_tokens + sum(x.text_tokens for x in session.turns[:turn + 1])
    if record.ttft is None:
        record.status, record.error = "empty", "the stream carried no text"
    return answer


async def _stop(task: asyncio.Task[None]) -> None:
    """Cancel ``task`` if it still runs and wait for it; a cancellation of the caller itself propagates."""
    if not task.done():
        task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        current = asyncio.current_task()
        if current is not None and current.cancelling():
            raise


class Runner:
    def __init__(self, cfg: BenchConfig, sessions: Iterator[Session], count_tokens: Callable[[str], int],
                 progress_stream: TextIO = sys.stderr) -> None:
        if (cfg.rate is None) == (cfg.concurrency is None):
            raise ValueError("give exactly one of --rate and --concurrency")
        if cfg.rate is not None and not cfg.rate > 0:
            raise ValueError(f"--rate must be > 0, got {cfg.rate}")
        if cfg.concurrency is not None and cfg.concurrency < 1:
            raise ValueError(f"--concurrency must be >= 1, got {cfg.concurrency}")
        if not cfg.duration > 0:
            raise ValueError(f"--duration must be > 0, got {cfg.duration}")
        self.cfg, self.sessions, self.count_tokens = cfg, sessions, count_tokens
        self.records: list[RequestRecord] = []
        self.samples: list[dict[str, float]] = []
        self.in_flight = 0
        self.progress = Progress(cfg.duration, progress_stream, cfg.progress)
        self.t0 = 0.0
        self.deadline = 0.0
        self.session_index = 0

    async def _session(self, client: httpx.AsyncClient, session: Session) -> None:
        index, self.session_index = self.session_index, self.session_index + 1
        answers: list[str] = []
        for turn in range(len(session.turns)):
            if time.perf_counter() >= self.deadline:
                return
            record = RequestRecord(start=time.perf_counter(), label=session.label, session=index, turn=turn)
            self.records.append(record)
            self.in_flight += 1
            try:
                text = await send(client, self.cfg, session, turn, answers, record, self.count_tokens)
                answers.append(text)
            except asyncio.CancelledError:
                record.status = "cancelled"
                raise
            except httpx.TimeoutException:
                record.status, record.error = "timeout", "no answer within --request-timeout"
            except (httpx.HTTPError, json.JSONDecodeError, ValueError) as exc:
                record.status, record.error = type(exc).__name__, str(exc)[:300]
            finally:
                self.in_flight -= 1
            if not record.ok:
                return

    async def _closed_loop(self, client: httpx.AsyncClient) -> None:
        async def loop() -> None:
            while time.perf_counter() < self.deadline:
                failed = sum(1 for r in self.records if not r.ok)
                await self._session(client, next(self.sessions))
                if sum(1 for r in self.records if not r.ok) > failed:
                    await asyncio.sleep(FAILURE_PAUSE)  # no busy loop against a server that refuses at once

        await asyncio.gather(*(loop() for _ in range(self.cfg.concurrency or 1)))

    async def _open_loop(self, client: httpx.AsyncClient) -> None:
        rng = random.Random(self.cfg.seed + 1)
        tasks: set[asyncio.Task[None]] = set()
        next_at = self.t0
        while True:
            next_at += rng.expovariate(self.cfg.rate or 1.0)
            if next_at >= self.deadline:
                break
            await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
            task = asyncio.create_task(self._session(client, next(self.sessions)))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        if tasks:
            await asyncio.gather(*tasks)

    async def _sample(self, client: httpx.AsyncClient) -> None:
        workers_ok = True
        while True:
            sample: dict[str, float] = {"t": time.perf_counter() - self.t0}
            with contextlib.suppress(httpx.HTTPError, ValueError):
                resp = await client.get(f"{self.cfg.url}/metrics", headers=headers(self.cfg.api_key),
                                        timeout=5)
                if resp.status_code == 200:
                    sample.update(metrics_sample(parse_prometheus(resp.text)))
            if workers_ok:
                try:
                    resp = await client.get(f"{self.cfg.url}/v1/workers", headers=headers(self.cfg.api_key),
                                            timeout=5)
                    workers_ok = resp.status_code in (200, 503)
                    if resp.status_code == 200:
                        sample.update(workers_sample(resp.json()))
                except (httpx.HTTPError, ValueError):
                    pass
            sample["client_in_flight"] = float(self.in_flight)
            if len(sample) > 2:
                self.samples.append(sample)
            done = sum(1 for r in self.records if r.ok and r.e2e is not None)
            self.progress.update(sample["t"], done, sum(1 for r in self.records if not r.ok), self.in_flight)
            await asyncio.sleep(self.cfg.metrics_interval)

    async def run(self) -> RunResult:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        async with httpx.AsyncClient(limits=limits, timeout=self.cfg.request_timeout) as client:
            self.t0 = time.perf_counter()
            self.deadline = self.t0 + self.cfg.duration
            sampler = asyncio.create_task(self._sample(client))
            driver = asyncio.create_task(self._open_loop(client) if self.cfg.rate is not None
                                         else self._closed_loop(client))
            try:
                await asyncio.wait({driver}, timeout=self.cfg.duration + self.cfg.drain_timeout)
            finally:
                await _stop(driver)
                await _stop(sampler)
        ends = [r.start + r.e2e for r in self.records if r.e2e is not None]
        duration = min(max([self.deadline, *ends]), time.perf_counter()) - self.t0
        done = sum(1 for r in self.records if r.ok)
        self.progress.update(self.cfg.duration, done, len(self.records) - done, 0, force=True)
        self.progress.close()
        return RunResult(self.records, duration, self.samples)


def run_bench(cfg: BenchConfig, sessions: Iterator[Session], count_tokens: Callable[[str], int],
              progress_stream: TextIO = sys.stderr) -> RunResult:
    """Run the load for ``cfg.duration`` seconds (plus draining) and return every request's record."""
    return asyncio.run(Runner(cfg, sessions, count_tokens, progress_stream).run())

"""What the HTTP router costs: per-request latency and streamed tokens/s over HTTP vs. PDClient directly.

``python -m bench.lab.router_overhead [--requests 50] [--concurrency 8] [--max-tokens 256]``

One prefill and one decode worker start as Ray actors in a local Ray instance.
The router (the ``create_app`` + ``PDClient`` + uvicorn that ``pdserve
serve`` runs) starts in its own process on a free port, attached to that Ray
instance with its own ``PDClient`` over the same two workers, so both paths
measured here reach exactly the same workers:

* latency: each of ``--requests`` distinct text prompts (warmed once, so both
  paths see the same prefix cache) is sent non-streaming with ``max_tokens`` 1
  and 16 (``ignore_eos``, greedy) over HTTP ``/v1/completions`` and directly
  through a ``PDClient`` in this process, alternating which goes first; the
  router's cost is the paired difference (tokenizing, detokenizing, JSON, HTTP).
* throughput: ``--stream-requests`` streaming requests of ``--max-tokens``
  tokens each at ``--concurrency``, total output tokens / wall time, over HTTP
  (SSE) and directly; plus the router process's CPU use, idle (its PDClient polls
  worker stats) and while streaming, and its CPU time per 1,000 streamed tokens
  above idle.

On a small CPU-only host the router, this process and both workers share the
cores, so differences of a few per cent are within run-to-run noise.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import ray

from cluster.placement import UNPLACED
from cluster.serve import serving_max_model_len
from cluster.workers import start_workers
from engine.config import EngineConfig
from engine.loader import load_model_source, resolve_model
from engine.sampling_params import SamplingParams
from messages.wire import GenerateRequest
from router.client import PDClient
from router.config import ClientConfig

NAMESPACE = "pdserve-bench"
LATENCY_MAX_TOKENS = (1, 16)
READY_TIMEOUT = 300.0
IDLE_SECONDS = 5.0


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(dtype=args.dtype, device=args.device, kv_cache_memory=args.kv_cache_memory * 2**20)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run_router(args: argparse.Namespace) -> None:
    """The router process: attach to the bench's Ray, find its workers by name, serve HTTP."""
    import uvicorn

    from router.app import create_app
    from router.config import RouterConfig

    path = resolve_model(args.model)
    source = load_model_source(path)
    ray.init(address=args.ray_address, namespace=NAMESPACE, log_to_driver=False)
    prefill = [ray.get_actor(f"{args.prefix}-prefill-0")]
    decode = [ray.get_actor(f"{args.prefix}-decode-0")]
    client = PDClient(prefill, decode, ClientConfig())
    max_len = serving_max_model_len(source, engine_config(args))
    config = RouterConfig(model_name="bench", max_model_len=max_len)
    app = create_app(client, source.load_tokenizer(), config)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=args.port, log_level="warning",
                                           access_log=False, timeout_graceful_shutdown=5))

    async def serve() -> None:
        task = asyncio.create_task(client.start(READY_TIMEOUT))
        await server.serve()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(serve())


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Paths:
    """The two ways to reach the same workers: HTTP through the router, and a PDClient directly."""

    def __init__(self, http: httpx.AsyncClient, url: str, client: PDClient,
                 encode: Callable[[str], list[int]]) -> None:
        self.http, self.url, self.client, self.encode = http, url, client, encode

    def body(self, prompt: str, max_tokens: int, stream: bool) -> dict[str, Any]:
        body: dict[str, Any] = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens,
                                "temperature": 0, "ignore_eos": True, "stream": stream}
        if stream:
            body["stream_options"] = {"include_usage": True}
        return body

    async def http_once(self, prompt: str, max_tokens: int) -> int:
        resp = await self.http.post(f"{self.url}/v1/completions", json=self.body(prompt, max_tokens, False))
        resp.raise_for_status()
        return int(resp.json()["usage"]["completion_tokens"])

    async def http_stream(self, prompt: str, max_tokens: int) -> int:
        tokens = 0
        async with self.http.stream("POST", f"{self.url}/v1/completions",
                                    json=self.body(prompt, max_tokens, True)) as resp:
            resp.raise_for_status()
            async for line in resp.aiter_lines():
                if line.startswith("data: {"):
                    usage = json.loads(line[6:]).get("usage")
                    tokens = int(usage["completion_tokens"]) if usage else tokens
        return tokens

    async def direct(self, prompt: str, max_tokens: int) -> int:
        req = GenerateRequest(request_id=uuid.uuid4().hex, prompt_token_ids=self.encode(prompt),
                              sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                      ignore_eos=True))
        tokens = 0
        async for batch in self.client.generate(req):
            tokens += len(batch.token_ids)
        return tokens


async def timed(call: Awaitable[int], expected: int) -> float:
    start = time.perf_counter()
    got = await call
    if got != expected:
        raise RuntimeError(f"expected {expected} tokens, got {got}")
    return time.perf_counter() - start


async def latency(paths: Paths, prompts: list[str], max_tokens: int) -> dict[str, float]:
    http: list[float] = []
    direct: list[float] = []
    for i, prompt in enumerate(prompts):
        if i % 2:
            direct.append(await timed(paths.direct(prompt, max_tokens), max_tokens))
            http.append(await timed(paths.http_once(prompt, max_tokens), max_tokens))
        else:
            http.append(await timed(paths.http_once(prompt, max_tokens), max_tokens))
            direct.append(await timed(paths.direct(prompt, max_tokens), max_tokens))
    diff = [h - d for h, d in zip(http, direct, strict=True)]
    return {f"{name}_p{q}": 1000 * percentile(values, q / 100) for name, values in
            (("http", http), ("direct", direct), ("added", diff)) for q in (50, 90)}


async def throughput(send: Callable[[str, int], Awaitable[int]], prompts: list[str], max_tokens: int,
                     concurrency: int) -> tuple[int, float]:
    sem = asyncio.Semaphore(concurrency)

    async def one(prompt: str) -> int:
        async with sem:
            return await send(prompt, max_tokens)

    start = time.perf_counter()
    counts = await asyncio.gather(*[one(p) for p in prompts])
    if any(c != max_tokens for c in counts):
        raise RuntimeError(f"short streams: {counts}")
    return sum(counts), time.perf_counter() - start


async def wait_healthy(url: str, router: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + READY_TIMEOUT
    async with httpx.AsyncClient(timeout=2) as http:
        while True:
            if router.poll() is not None:
                raise RuntimeError(f"router exited with {router.returncode}:\n{log.read_text()[-3000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if (await http.get(f"{url}/health")).status_code == 200:
                    return
            if time.monotonic() > deadline:
                raise TimeoutError(f"router not healthy within {READY_TIMEOUT} s")
            await asyncio.sleep(0.5)


async def measure(args: argparse.Namespace, prefix: str, router: subprocess.Popen[bytes], url: str,
                  log: Path) -> dict[str, Any]:
    group = ray.get_actor(f"{prefix}-prefill-0"), ray.get_actor(f"{prefix}-decode-0")
    client = PDClient([group[0]], [group[1]], ClientConfig())
    await client.start(READY_TIMEOUT)
    await wait_healthy(url, router, log)
    tokenizer = load_model_source(resolve_model(args.model)).load_tokenizer()
    conns = 2 * args.concurrency
    limits = httpx.Limits(max_connections=conns, max_keepalive_connections=conns)
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        paths = Paths(http, url, client, tokenizer.encode)
        prompts = [f"Note {i}: summarise the lighthouse keeper's log for day {i} in one line."
                   for i in range(args.requests)]
        for p in prompts[:4]:  # warm-up: first forwards, connections, detokenizer caches
            await paths.http_once(p, 2)
        for p in prompts:  # both paths then find the same prefix blocks cached
            await paths.direct(p, 1)
        result: dict[str, Any] = {"latency": {}}
        for k in LATENCY_MAX_TOKENS:
            result["latency"][k] = await latency(paths, prompts, k)
        stream_prompts = [f"Story {i}: the tide came in and" for i in range(args.stream_requests)]
        cpu0 = cpu_seconds(router.pid)
        await asyncio.sleep(IDLE_SECONDS)
        idle_cpu = (cpu_seconds(router.pid) - cpu0) / IDLE_SECONDS
        cpu0 = cpu_seconds(router.pid)
        http_tokens, http_wall = await throughput(paths.http_stream, stream_prompts, args.max_tokens,
                                                  args.concurrency)
        router_cpu = cpu_seconds(router.pid) - cpu0
        direct_tokens, direct_wall = await throughput(paths.direct, stream_prompts, args.max_tokens,
                                                      args.concurrency)
    await client.close()
    result["throughput"] = {"http_tok_s": http_tokens / http_wall,
                            "direct_tok_s": direct_tokens / direct_wall,
                            "router_cpu_idle": idle_cpu, "router_cpu_streaming": router_cpu / http_wall,
                            "router_cpu_ms_per_1k_tokens": 1e6 * (router_cpu - idle_cpu * http_wall)
                            / http_tokens,
                            "tokens": http_tokens}
    return result


def machine_info(args: argparse.Namespace) -> str:
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name")), cpu)
    return (f"machine: {cpu}, {os.cpu_count()} cores; Python {platform.python_version()}, "
            f"Ray {ray.__version__}; "
            f"workers on {args.device} ({args.dtype}), 1 prefill + 1 decode; router in its own process")


def markdown(args: argparse.Namespace, result: dict[str, Any]) -> str:
    lines = [f"### Router overhead ({args.requests} requests, sequential)", "",
             "| max_tokens | HTTP p50 (ms) | HTTP p90 (ms) | direct p50 (ms) | direct p90 (ms) "
             "| added p50 (ms) | added p90 (ms) |", "|---|---|---|---|---|---|---|"]
    for k, row in result["latency"].items():
        lines.append(f"| {k} | {row['http_p50']:.1f} | {row['http_p90']:.1f} | {row['direct_p50']:.1f} "
                     f"| {row['direct_p90']:.1f} | {row['added_p50']:.1f} | {row['added_p90']:.1f} |")
    t = result["throughput"]
    lines += ["", f"### Streaming ({args.stream_requests} requests x {args.max_tokens} tokens, "
              f"concurrency {args.concurrency}, ignore_eos)", "",
              "| path | output tokens/s | router CPU, % of a core (idle -> streaming) "
              "| router CPU ms / 1k tokens above idle |", "|---|---|---|---|",
              f"| HTTP (SSE) via router | {t['http_tok_s']:.1f} | {100 * t['router_cpu_idle']:.1f}% -> "
              f"{100 * t['router_cpu_streaming']:.1f}% | {t['router_cpu_ms_per_1k_tokens']:.1f} |",
              f"| PDClient direct | {t['direct_tok_s']:.1f} | - | - |",
              f"| HTTP / direct | {t['http_tok_s'] / t['direct_tok_s']:.3f} | | |", "", machine_info(args)]
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--requests", type=int, default=50, help="requests per latency setting (default: 50)")
    parser.add_argument("--concurrency", type=int, default=8, help="streams in flight (default: 8)")
    parser.add_argument("--max-tokens", type=int, default=256,
                        help="tokens per streamed request (default: 256)")
    parser.add_argument("--stream-requests", type=int, default=None,
                        help="streamed requests per path (default: 2 x concurrency)")
    parser.add_argument("--model", default=None, help="model folder or .gguf (default: built-in SmolLM2)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--kv-cache-memory", type=int, default=512, metavar="MIB")
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument("--router", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--ray-address", help=argparse.SUPPRESS)
    parser.add_argument("--prefix", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.stream_requests = args.stream_requests or 2 * args.concurrency
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.router:
        run_router(args)
        return 0
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    ray.init(address="local", num_cpus=4, namespace=NAMESPACE, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    prefix = f"bench-{uuid.uuid4().hex[:6]}"
    opts = replace(UNPLACED, num_cpus=0.5)
    group = start_workers(args.model, engine_config(args), 1, 1, opts, opts, name_prefix=prefix)
    port = free_port()
    log = Path(tempfile.mkdtemp(prefix="pdserve-bench-")) / "router.log"
    cmd = [sys.executable, "-m", "bench.lab.router_overhead", "--router", "--ray-address",
           ray.get_runtime_context().gcs_address, "--prefix", prefix, "--port", str(port),
           "--dtype", args.dtype, "--device", args.device, "--kv-cache-memory", str(args.kv_cache_memory)]
    if args.model:
        cmd += ["--model", args.model]
    with log.open("wb") as out:
        router = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    try:
        result = asyncio.run(measure(args, prefix, router, f"http://127.0.0.1:{port}", log))
    finally:
        router.terminate()
        try:
            router.wait(30)
        except subprocess.TimeoutExpired:
            router.kill()
            router.wait(10)
        for actor in group.all():
            with contextlib.suppress(Exception):
                ray.kill(actor)
        ray.shutdown()
    print(markdown(args, result))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), **result}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

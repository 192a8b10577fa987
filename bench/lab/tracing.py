"""Throughput of `pdserve serve` with tracing off vs on (every request traced, ratio 1.0).

The load is closed-loop: ``--concurrency`` clients sending disaggregated chat requests
(``--prompt-tokens`` long, ``--max-tokens`` generated, greedy, ``ignore_eos``), ``--requests`` per
run, output tokens/s measured per run. Spans go to an OTLP/HTTP sink in this process.

Default (``--mode interleaved``, robust on a noisy machine): one server started with
``--otlp-traces-endpoint`` and ratio 1.0; runs alternate between requests sent with a sampled
``traceparent`` (every hop records and exports its spans) and an unsampled one (nothing is recorded
anywhere). ``--mode servers``: each round starts a server with tracing off (no endpoint at all), then
one with it on, one after the other. Prints each run and the median cost of tracing.

    python -m bench.lab.tracing --rounds 5 --concurrency 4 --requests 24
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import socket
import statistics
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[2]
WORDS = "the keeper counted ships and wrote their names in a leather book by the light of the lamp "


class SpanSink:
    """An OTLP/HTTP endpoint that answers 200 to every export and counts the bytes received."""

    def __init__(self) -> None:
        self.bytes = 0
        sink = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                sink.bytes += len(self.rfile.read(int(self.headers.get("Content-Length", "0"))))
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_server(args: argparse.Namespace, extra: list[str]) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    cmd = [sys.executable, "-m", "cli.main", "serve", "--port", str(port), "--served-model-name", "bench",
           "--num-prefill", "1", "--num-decode", "1", "--worker-cpus", "0.5", "--kv-cache-memory", "512M",
           *extra]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"pdserve serve exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("pdserve serve not healthy within 300 s")


async def load(url: str, args: argparse.Namespace, n: int, sampled: bool | None = None) -> tuple[float, int]:
    """Send ``n`` requests with ``--concurrency`` clients; (seconds, output tokens). ``sampled`` sends a
    ``traceparent`` with that sampled flag on every request."""
    prompt = (WORDS * (args.prompt_tokens // 18 + 1)).split(" ")[:args.prompt_tokens]
    counter = iter(range(n))
    tokens = 0

    async def client(http: httpx.AsyncClient) -> None:
        nonlocal tokens
        for i in counter:
            body = {"model": "bench", "max_tokens": args.max_tokens, "temperature": 0.0, "ignore_eos": True,
                    "messages": [{"role": "user", "content": f"{i} " + " ".join(prompt)}]}
            headers = {}
            if sampled is not None:
                flag = "01" if sampled else "00"
                headers["traceparent"] = f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-{flag}"
            resp = await http.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=600)
            resp.raise_for_status()
            tokens += resp.json()["usage"]["completion_tokens"]

    async with httpx.AsyncClient() as http:
        t0 = time.perf_counter()
        await asyncio.gather(*[client(http) for _ in range(args.concurrency)])
        return time.perf_counter() - t0, tokens


def run_once(args: argparse.Namespace, extra: list[str]) -> float:
    proc, url = start_server(args, extra)
    try:
        asyncio.run(load(url, args, args.concurrency))  # warm-up
        seconds, tokens = asyncio.run(load(url, args, args.requests))
    finally:
        proc.terminate()
        proc.wait(60)
    return tokens / seconds


def interleaved(args: argparse.Namespace, on_flags: list[str]) -> tuple[list[float], list[float]]:
    proc, url = start_server(args, on_flags)
    off: list[float] = []
    on: list[float] = []
    try:
        asyncio.run(load(url, args, args.concurrency, sampled=True))  # warm-up
        for r in range(args.rounds):
            for sampled, out in ((False, off), (True, on)) if r % 2 == 0 else ((True, on), (False, off)):
                seconds, tokens = asyncio.run(load(url, args, args.requests, sampled))
                out.append(tokens / seconds)
            print(f"round {r + 1}: tracing off {off[-1]:.1f} tok/s, on {on[-1]:.1f} tok/s", flush=True)
    finally:
        proc.terminate()
        proc.wait(60)
    return off, on


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--prompt-tokens", type=int, default=200)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--mode", choices=("interleaved", "servers"), default="interleaved")
    args = p.parse_args()
    sink = SpanSink()
    on_flags = ["--otlp-traces-endpoint", sink.url, "--otlp-traces-sample-ratio", "1.0"]
    if args.mode == "interleaved":
        off, on = interleaved(args, on_flags)
    else:
        off, on = [], []
        for r in range(args.rounds):
            off.append(run_once(args, []))
            on.append(run_once(args, on_flags))
            print(f"round {r + 1}: tracing off {off[-1]:.1f} tok/s, on {on[-1]:.1f} tok/s", flush=True)
    cost = 1 - statistics.median(on) / statistics.median(off)
    print(f"median output tokens/s: off {statistics.median(off):.1f}, on {statistics.median(on):.1f}; "
          f"tracing cost {100 * cost:+.1f}% ({sink.bytes} OTLP bytes received)")


if __name__ == "__main__":
    main()

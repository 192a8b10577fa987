"""Throughput of `pdserve serve` with tracing off vs on (every request traced, ratio 1.0).

Each round starts one server with tracing off and one with ``--otlp-traces-endpoint`` pointed at an
OTLP/HTTP sink in this process (it accepts and counts the spans), one after the other, and drives each
with the same closed-loop load: ``--concurrency`` clients sending disaggregated chat requests
(``--prompt-tokens`` long, ``--max-tokens`` generated, greedy, ``ignore_eos``) for ``--requests``
requests. Prints requests/s and output tokens/s per run and the median cost of tracing.

    python -m bench.tracing --rounds 3 --concurrency 8 --requests 48
"""

from __future__ import annotations

import argparse
import asyncio
import os
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

ROOT = Path(__file__).resolve().parents[1]
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
    cmd = [sys.executable, "-m", "cluster.cli", "serve", "--port", str(port), "--served-model-name", "bench",
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


async def load(url: str, args: argparse.Namespace, n: int) -> tuple[float, int]:
    """Send ``n`` requests with ``--concurrency`` clients; (seconds, output tokens)."""
    prompt = (WORDS * (args.prompt_tokens // 18 + 1)).split(" ")[:args.prompt_tokens]
    counter = iter(range(n))
    tokens = 0

    async def client(http: httpx.AsyncClient) -> None:
        nonlocal tokens
        for i in counter:
            body = {"model": "bench", "max_tokens": args.max_tokens, "temperature": 0.0, "ignore_eos": True,
                    "messages": [{"role": "user", "content": f"{i} " + " ".join(prompt)}]}
            resp = await http.post(f"{url}/v1/chat/completions", json=body, timeout=600)
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--prompt-tokens", type=int, default=200)
    p.add_argument("--max-tokens", type=int, default=32)
    args = p.parse_args()
    sink = SpanSink()
    on_flags = ["--otlp-traces-endpoint", sink.url, "--otlp-traces-sample-ratio", "1.0"]
    off: list[float] = []
    on: list[float] = []
    for r in range(args.rounds):
        off.append(run_once(args, []))
        on.append(run_once(args, on_flags))
        print(f"round {r + 1}: tracing off {off[-1]:.1f} tok/s, on {on[-1]:.1f} tok/s", flush=True)
    cost = 1 - statistics.median(on) / statistics.median(off)
    print(f"median output tokens/s: off {statistics.median(off):.1f}, on {statistics.median(on):.1f}; "
          f"tracing cost {100 * cost:+.1f}% ({sink.bytes} OTLP bytes received)")


if __name__ == "__main__":
    main()

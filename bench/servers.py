"""Servers a comparison starts and stops: ``pdserve serve`` (or any command) on a free local port.

``server(cmd, url, log)`` runs ``cmd`` in its own process group with its output in ``log``, yields
``url`` once the server is ready (``/health`` answers 200, or, for a server without ``/health``,
``/v1/models`` answers 200) and, when the block ends, stops the whole group (SIGTERM, then SIGKILL
after 60 s). A server that exits or is not ready within ``ready_timeout`` is a ``RuntimeError`` naming
its log. ``RAY_ADDRESS`` is not passed on: each ``pdserve serve`` starts a Ray instance of its own.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def ready(url: str) -> bool:
    """``/health`` answers 200 (pdserve: all workers up), or there is no /health and /v1/models answers."""
    try:
        health = httpx.get(f"{url}/health", timeout=2).status_code
        if health == 404:
            return httpx.get(f"{url}/v1/models", timeout=2).status_code == 200
        return health == 200
    except httpx.HTTPError:
        return False


@contextlib.contextmanager
def server(cmd: list[str], url: str, log: Path, ready_timeout: float = 600.0) -> Iterator[str]:
    """Run ``cmd`` (a server, in its own process group) until the block ends; yields ``url`` once ready."""
    log.parent.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    with log.open("wb") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + ready_timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}; see {log}")
            if ready(url):
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"server not ready within {ready_timeout:.0f} s; see {log}")
            time.sleep(1.0)
        yield url
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)


def pdserve_cmd(port: int, *flags: str) -> list[str]:
    """``pdserve serve`` on ``port`` with ``flags``, run by this interpreter."""
    return [sys.executable, "-m", "cli.main", "serve", "--port", str(port), *flags]

"""Screenshot one request's trace waterfall in Arize Phoenix (headless Chromium) -> docs/trace.png.

Starts Phoenix (the venv scripts/observe.sh installs, $PDSERVE_CACHE/phoenix-venv) and `pdserve serve`
tracing into it, sends one disaggregated chat request with a known ``traceparent``, waits for its spans,
and has Chromium (Debian package ``chromium``, installed by scripts/ensure_apt.sh when missing) take
the screenshot of that trace's page: its span tree with each hop's duration. With playwright-core
(npm) under $PDSERVE_CACHE/playwright it also selects the ``kv.transfer`` span so its attributes
show; without it Chromium's own ``--screenshot`` takes the page as it loads. Everything it starts is
stopped at the end.

    bash scripts/ensure_apt.sh chromium chromium
    npm install --prefix ~/.cache/pdserve/playwright playwright-core@1.65.1   # optional
    .venv/bin/python scripts/trace_screenshot.py [OUT.png]
"""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("PDSERVE_CACHE", Path.home() / ".cache" / "pdserve"))
PLAYWRIGHT = Path(os.environ.get("PLAYWRIGHT_NODE_MODULES", CACHE / "playwright" / "node_modules"))
PHOENIX_PY = Path(os.environ.get("PHOENIX_PYTHON", CACHE / "phoenix-venv" / "bin" / "python"))
STORY = ("The lighthouse keeper counted the ships that passed each night and wrote their names in a "
         "leather book, noting the wind, the tide and the colour of every sail. ")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_http(url: str, timeout: float, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args!r} exited with {proc.returncode}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} not up within {timeout} s")


def main() -> None:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else ROOT / "docs" / "trace.png").resolve()
    work = Path(tempfile.mkdtemp(prefix="pdserve-trace-"))
    ui, grpc, api = free_port(), free_port(), free_port()
    env = {**os.environ, "PHOENIX_HOST": "127.0.0.1", "PHOENIX_PORT": str(ui), "PHOENIX_GRPC_PORT": str(grpc),
           "PHOENIX_WORKING_DIR": str(work / "phoenix"), "PHOENIX_TELEMETRY_ENABLED": "false",
           "PHOENIX_ALLOW_EXTERNAL_RESOURCES": "false"}
    procs = [subprocess.Popen([str(PHOENIX_PY), str(ROOT / "scripts" / "phoenix_local.py")], env=env,
                              stdout=(work / "phoenix.log").open("wb"), stderr=subprocess.STDOUT)]
    try:
        phoenix = f"http://127.0.0.1:{ui}"
        wait_http(phoenix + "/healthz", 180, procs[0])
        serve_env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "cli.main", "serve", "--port", str(api),
             "--served-model-name", "smollm2", "--worker-cpus", "0.5", "--kv-cache-memory", "256M",
             "--otlp-traces-endpoint", f"{phoenix}/v1/traces"],
            cwd=ROOT, env=serve_env, stdout=(work / "serve.log").open("wb"), stderr=subprocess.STDOUT))
        wait_http(f"http://127.0.0.1:{api}/health", 300, procs[1])
        trace_id = secrets.token_hex(16)
        body = {"model": "smollm2", "max_tokens": 24, "temperature": 0.0,
                "messages": [{"role": "user", "content": STORY * 3 + "What did the keeper write down?"}]}
        resp = httpx.post(f"http://127.0.0.1:{api}/v1/chat/completions", json=body, timeout=120,
                          headers={"traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-01"})
        resp.raise_for_status()
        project = ""
        for _ in range(60):
            time.sleep(1)
            projects = httpx.get(f"{phoenix}/v1/projects", timeout=10).json()["data"]
            project = next((p["id"] for p in projects if p["name"] == "pdserve"), "")
            spans = httpx.get(f"{phoenix}/v1/projects/pdserve/spans", params={"limit": 100}, timeout=10)
            got = [s for s in spans.json().get("data", []) if s["context"]["trace_id"] == trace_id]
            if project and len(got) >= 6:
                break
        url = f"{phoenix}/projects/{project}/traces/{trace_id}"
        if PLAYWRIGHT.is_dir():  # also selects the kv.transfer span to show its attributes
            script = str(ROOT / "scripts" / "trace_screenshot.cjs")
            subprocess.run(["node", script, url, str(out)], check=True, timeout=240,
                           env={**os.environ, "NODE_PATH": str(PLAYWRIGHT)})
        else:
            flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                     "--disable-background-networking", "--disable-component-update", "--disable-sync",
                     f"--user-data-dir={work / 'chromium'}", "--window-size=1600,1000",
                     "--virtual-time-budget=15000", "--hide-scrollbars", f"--screenshot={out}"]
            subprocess.run(["/usr/bin/chromium", *flags, url], check=True, timeout=180,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        print(f"{out} ({url})")
    finally:
        for p in reversed(procs):
            p.terminate()
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()


if __name__ == "__main__":
    main()

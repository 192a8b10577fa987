"""`pdserve serve` with tensor-parallel decode workers over real HTTP: one prefill worker (TP=1) and two
decode workers of two ranks each (``--decode-tp 2``: the actor is rank 0, rank 1 its process), on a tiny
random Llama (8 query / 2 KV heads). Greedy tokens equal TP=1 in process; a killed rank takes its whole
worker down and back up (Ray restarts it), and the stream it was serving migrates and completes."""

from __future__ import annotations

import contextlib
import json
import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from engine import LLM, SamplingParams
from tests.integration.test_tensor_parallel import prompts, save
from tests.waiting import wait_until

if TYPE_CHECKING:
    from tests.integration.conftest import PdserveServer

pytestmark = pytest.mark.slow

MODEL = "tiny"
HEADER = "x-pdserve-decode-worker"
LONG = 300  # tokens: the stream is still going when its rank dies


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-llama")
    save("llama", path)
    return path


@pytest.fixture(scope="module")
def server(pdserve_factory: Callable[..., PdserveServer], model: Path) -> PdserveServer:
    return pdserve_factory("--model", str(model), "--served-model-name", MODEL, "--dtype", "float32",
                           "--num-decode", "2", "--decode-tp", "2", "--tp-timeout", "20",
                           "--routing", "round-robin", "--migration-limit", "1", "--disagg-min-tokens", "1")


def complete(ids: list[int], max_tokens: int, stream: bool = False) -> dict[str, Any]:
    return {"model": MODEL, "prompt": ids, "max_tokens": max_tokens, "temperature": 0, "stream": stream}


def workers(server: PdserveServer) -> dict[str, dict[str, Any]]:
    resp = httpx.get(f"{server.url}/v1/workers", timeout=10)
    assert resp.status_code == 200, resp.text
    return {w["worker_id"]: w for w in resp.json()["workers"]}


def rank_pids(pid: int) -> list[int]:
    """The tensor-parallel rank processes a worker's process started (multiprocessing spawn children)."""
    children: list[str] = []
    for task in Path(f"/proc/{pid}/task").iterdir():  # any thread of it may have started them
        with contextlib.suppress(FileNotFoundError):
            children += (task / "children").read_text().split()
    return [int(c) for c in children if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]


def gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except FileNotFoundError:
        return True


def test_tp2_decode_over_http_equals_tp1(server: PdserveServer, model: Path) -> None:
    batch = prompts()
    llm = LLM(model=str(model), dtype="float32", num_threads=1, kv_cache_memory=1024**2,
              linear_kernel="plain")  # the server's kernel (SERVER_FLAGS)
    greedy = SamplingParams(max_tokens=16, temperature=0.0)
    expected = [llm.tokenizer.decode(o.token_ids) for o in llm.generate(batch, greedy)]
    seen = set()
    for ids, want in zip(batch, expected, strict=True):
        for _ in range(2):  # round-robin: each prompt on both decode workers
            resp = httpx.post(f"{server.url}/v1/completions", json=complete(ids, 16), timeout=60)
            assert resp.status_code == 200, resp.text
            assert resp.json()["choices"][0]["text"] == want
            seen.add(resp.headers[HEADER])
    assert seen == {"decode-0", "decode-1"}
    stats = workers(server)
    assert stats["decode-0"]["transfer"]["blocks"] > 0  # disaggregated: prefill TP=1 -> decode TP=2
    for worker in ("decode-0", "decode-1"):
        assert len(rank_pids(stats[worker]["pid"])) == 1
    assert rank_pids(stats["prefill-0"]["pid"]) == []


def test_a_killed_rank_restarts_its_worker_and_the_stream_migrates(server: PdserveServer) -> None:
    ids = prompts()[1]
    baseline = httpx.post(f"{server.url}/v1/completions", json=complete(ids, LONG), timeout=120)
    assert baseline.status_code == 200, baseline.text
    text: list[str] = []
    finish: list[str] = []
    killed: dict[str, Any] = {}
    with httpx.Client(timeout=120) as http, \
            http.stream("POST", f"{server.url}/v1/completions", json=complete(ids, LONG, True)) as resp:
        assert resp.status_code == 200
        victim = resp.headers[HEADER]
        n = 0
        for line in resp.iter_lines():
            if not line.startswith("data: {"):
                continue
            n += 1
            choice = json.loads(line[6:])["choices"][0]
            text.append(choice["text"])
            if choice["finish_reason"]:
                finish.append(choice["finish_reason"])
            if n == 4:
                assert not finish, "the stream ended before the kill"
                pid = workers(server)[victim]["pid"]
                [rank1] = rank_pids(pid)
                os.kill(rank1, signal.SIGKILL)
                killed = {"pid": pid, "rank1": rank1}
    assert killed, "the stream ended before its fifth event"
    assert "".join(text) == baseline.json()["choices"][0]["text"] and finish == ["length"]

    def restarted() -> dict[str, Any] | None:  # Ray restarts the worker; the client re-registers it
        back = workers(server).get(victim)
        return back if back is not None and back["pid"] not in (0, killed["pid"]) else None

    back = wait_until(restarted, 120, f"{victim} coming back", 0.5)
    assert gone(killed["pid"]) and gone(killed["rank1"])  # the whole old group ended
    assert len(rank_pids(back["pid"])) == 1  # ... and a new one of two ranks serves
    for _ in range(2):
        resp = httpx.post(f"{server.url}/v1/completions", json=complete(ids, 8), timeout=60)
        assert resp.status_code == 200, resp.text

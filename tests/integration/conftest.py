"""Ray is started once per test session (it costs seconds); workers load the model in their own processes."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from tests.integration.otlp_receiver import OtlpReceiver

if TYPE_CHECKING:
    from cluster.workers import WorkerGroup
    from engine.config import EngineConfig


@pytest.fixture(scope="session")
def ray_session() -> Iterator[None]:
    import ray

    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    ray.init(address="local", num_cpus=16, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    yield
    ray.shutdown()


@dataclass
class PdserveServer:
    """A ``pdserve serve`` subprocess on a free local port."""

    url: str
    process: subprocess.Popen[bytes]
    log_path: Path

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def kill_group(self) -> None:
        """SIGTERM to the server's process group (it and the local Ray it started), SIGKILL 30 s later."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.process.pid, sig)
                self.process.wait(30)
                return
            except ProcessLookupError:
                return
            except subprocess.TimeoutExpired:
                continue

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM, then the exit code; fails when the process is still alive after ``timeout``."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(10)
            pytest.fail(f"pdserve serve did not exit within {timeout} s of SIGTERM\n{self.log_tail()}")


# Listening ports come from below the kernel's ephemeral range (32768-60999 on Linux) and above Ray's
# worker ports (10002-19999): a port the kernel picked (bind to 0) is free only until a server binds it
# seconds later, and meanwhile every outgoing connection (Ray's, gRPC's, the other xdist worker's) draws
# from that same range. A CI run lost that race once ("address already in use" on 60717).
PORT_RANGE = (20000, 32767)


def _free_port() -> int:
    """A local port that binds now, drawn at random from ``PORT_RANGE``."""
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.randint(*PORT_RANGE)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {PORT_RANGE} after 200 draws")


# a server's start (its own local Ray, two or three worker processes loading the model) has taken over
# 180 s on a loaded 2-core machine
HEALTHY_WITHIN_S = 240
# `--linear-kernel plain`: no packed copy of the weights, so a worker holds ~1.3 GB, not ~1.9 GB (two
# xdist workers' servers and worker groups share 24 GB); the prepacked kernels run in the in-process tests.
# `--no-share-cores`: a test server's workers reserve half a CPU each beside the other xdist worker's load,
# so an idle prefill worker's reservation is no idle core (worker/core_share.py), as for the worker groups
# below; tests/integration/test_disagg.py tests sharing. With sharing on, full runs of the suite on a 2-core
# AMD EPYC failed test_bad_inputs.py's burst three times in three (its 3 admitted 8-token requests past the
# module's 6 s timeout), and once test_bench.py's runs as well; with it off, none in two.
SERVER_FLAGS = ("--num-prefill", "1", "--num-decode", "1", "--worker-cpus", "0.5", "--torch-threads", "1",
                "--kv-cache-memory", "256M", "--linear-kernel", "plain", "--no-share-cores")


def session_ray_address() -> str:
    """The GCS address of the session's Ray (``ray_session`` must be active)."""
    import ray

    return str(ray.get_runtime_context().gcs_address)


def _start_server(model: Path, tmp_path_factory: pytest.TempPathFactory, *extra: str,
                  address: str | None = None) -> PdserveServer:
    """Start ``pdserve serve`` with extra flags and wait for /health 200 (``HEALTHY_WITHIN_S``). With
    ``address`` it attaches to that Ray (``--address``); without, it starts its own local Ray."""
    for _ in range(BIND_ATTEMPTS):
        server = _launch(model, tmp_path_factory, *extra, address=address)
        if server is not None:
            return server
    pytest.fail(f"pdserve serve lost the race for its port {BIND_ATTEMPTS} times")


BIND_ATTEMPTS = 3


def _launch(model: Path, tmp_path_factory: pytest.TempPathFactory, *extra: str,
            address: str | None) -> PdserveServer | None:
    """One start of ``_start_server``: the healthy server, or None when another process bound its port
    first (the server exits naming it); any other exit fails the test."""
    root = Path(__file__).resolve().parents[2]
    port = _free_port()
    log_path = tmp_path_factory.mktemp("pdserve") / "serve.log"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    attach = ("--address", address) if address else ()
    cmd = [sys.executable, "-m", "cli.main", "serve", "--model", str(model),
           "--port", str(port), *SERVER_FLAGS, *attach, *extra]
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)  # its own process group, as in a terminal
    server = PdserveServer(f"http://127.0.0.1:{port}", proc, log_path)
    deadline = time.monotonic() + HEALTHY_WITHIN_S
    while True:
        if proc.poll() is not None:
            if f"--port {port} (--host 127.0.0.1): Address already in use" in server.log_tail():
                return None
            pytest.fail(f"pdserve serve exited with {proc.returncode}\n{server.log_tail()}")
        try:
            if httpx.get(f"{server.url}/health", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            server.kill_group()
            pytest.fail(f"pdserve serve not healthy within {HEALTHY_WITHIN_S} s\n{server.log_tail()}")
        time.sleep(0.5)


def _stop_all(servers: list[PdserveServer]) -> None:
    """Each server asserted to exit 0 within 30 s of SIGTERM."""
    codes = [s.stop() for s in reversed(servers)]
    assert codes == [0] * len(codes), codes


@pytest.fixture(scope="module")
def pdserve_factory(ray_session: None, default_model_path: Path,
                    tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., PdserveServer]]:
    """Start ``pdserve serve`` with extra flags (see ``_start_server``); all stop at module end. For a
    server the module configures or disturbs (kills its workers, fills its queues).

    ``start(*flags, own_ray=False)``: servers attach to the session's Ray (``--address``), as on a
    cluster, which spares each a Ray start; ``own_ray=True`` gives one its own local Ray, as
    ``pdserve serve`` on a laptop runs."""
    servers: list[PdserveServer] = []

    def start(*extra: str, own_ray: bool = False) -> PdserveServer:
        address = None if own_ray else session_ray_address()
        servers.append(_start_server(default_model_path, tmp_path_factory, *extra, address=address))
        return servers[-1]

    yield start
    _stop_all(servers)


@pytest.fixture(scope="session")
def otlp_receiver() -> Iterator[OtlpReceiver]:
    """An OTLP/HTTP trace receiver in this process; the default server exports every span to it."""
    receiver = OtlpReceiver()
    yield receiver
    receiver.close()


@pytest.fixture(scope="session")
def pdserve_server(ray_session: None, otlp_receiver: OtlpReceiver, default_model_path: Path,
                   tmp_path_factory: pytest.TempPathFactory) -> Iterator[PdserveServer]:
    """One default server (``SERVER_FLAGS``, on the session's Ray, tracing every request to
    ``otlp_receiver``) shared by every module that only sends it requests; a test that needs other
    flags or breaks a worker uses ``pdserve_factory``."""
    tracing = ("--otlp-traces-endpoint", otlp_receiver.url, "--otlp-traces-sample-ratio", "1.0")
    server = _start_server(default_model_path, tmp_path_factory, *tracing, address=session_ray_address())
    yield server
    _stop_all([server])


@pytest.fixture(scope="module")
def worker_group_factory(ray_session: None) -> Iterator[Callable[..., WorkerGroup]]:
    """Start prefill/decode worker actors in the session's Ray on the built-in model, connected to one
    another; every group started stops (its actors killed) at module end.

    ``start(config, num_prefill=1, num_decode=1, lease_seconds=60.0, **start_workers_kwargs)``. Shared
    cores are off unless a module asks (``share_cores=True``): this Ray is told of 16 CPUs on a 2-core
    machine, so an idle prefill worker's reservation is no idle core (``worker/core_share.py``)."""
    import ray

    from cluster.workers import start_workers
    from engine.loader import default_model_path
    from router.client import PDClient

    groups: list[WorkerGroup] = []

    def start(config: EngineConfig, num_prefill: int = 1, num_decode: int = 1, lease_seconds: float = 60.0,
              share_cores: bool = False, **kwargs: Any) -> WorkerGroup:
        group = start_workers(str(default_model_path()), config, num_prefill=num_prefill,
                              num_decode=num_decode, lease_seconds=lease_seconds, share_cores=share_cores,
                              **kwargs)
        groups.append(group)
        asyncio.run(PDClient(group.prefill, group.decode).start())
        return group

    yield start
    for group in groups:
        for actor in group.all():
            ray.kill(actor)

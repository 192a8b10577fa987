"""pdserve on a real multi-node Ray cluster, submitted as a Ray job with token authentication on.

The module starts its own cluster with ``ray start`` (own temp dir, own ports,
``RAY_AUTH_MODE=token``), two nodes on this machine: a head node (the job driver
and router run there) that also offers the custom resource ``prefill_node``, and
a worker node offering ``decode_node``. ``ray job submit`` runs
``python -m cli.main serve --address auto`` (what the ``pdserve`` script runs)
with ``--prefill-resources prefill_node=1 --decode-resources decode_node=1`` (and the
decode node's label, ``--decode-labels pdserve-role=decode_node``); the
tests check the actors' node ids, a request through the router, and that
``ray job stop`` leaves no pdserve actor and no placement group behind. Only the
processes this module started are killed at the end.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from cli.plan import make_plan, read_model_config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]  # starts a 2-node Ray cluster, then a job

ROOT = Path(__file__).resolve().parents[2]
RAY = str(Path(sys.executable).with_name("ray"))
ROLES = {"PrefillWorker": "prefill_node", "DecodeWorker": "decode_node"}
LATE_RAYLET = "timed out during startup"  # what `ray start` says when its raylet registers late

STATE_SCRIPT = """
import json, sys
from ray.util.state import list_actors, list_nodes, list_placement_groups
addr = sys.argv[1]
print(json.dumps({
    "actors": [dict(class_name=a.class_name, state=a.state, node_id=a.node_id, pid=a.pid, name=a.name)
               for a in list_actors(address=addr, limit=1000)],
    "nodes": [dict(node_id=n.node_id, state=n.state, resources=n.resources_total)
              for n in list_nodes(address=addr)],
    "groups": [dict(name=g.name, state=g.state) for g in list_placement_groups(address=addr)],
}))
"""


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [int(s.getsockname()[1]) for s in socks]
    for s in socks:
        s.close()
    return ports


@dataclass
class RayCluster:
    temp_dir: Path
    gcs_port: int
    dashboard: str
    env: dict[str, str]
    node_dirs: list[Path] = field(default_factory=list)  # the worker nodes' own temp dirs

    def run(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run(args, env=self.env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)

    def state(self) -> dict[str, Any]:
        done = self.run(sys.executable, "-c", STATE_SCRIPT, self.dashboard)
        assert done.returncode == 0, done.stderr[-3000:]
        return dict(json.loads(done.stdout.strip().splitlines()[-1]))

    def job_status(self, job_id: str) -> str:
        done = self.run(RAY, "job", "status", "--address", self.dashboard, job_id)
        return done.stdout + done.stderr

    def job_logs(self, job_id: str) -> str:
        done = self.run(RAY, "job", "logs", "--address", self.dashboard, job_id)
        return (done.stdout + done.stderr)[-4000:]

    def kill_own_processes(self, marks: tuple[str, ...] = ()) -> None:
        """Terminate every process of this cluster (found by its temp dirs or GCS port) and their children;
        with ``marks``, only the processes whose command line holds one of them."""
        marks = marks or (str(self.temp_dir), f":{self.gcs_port}", *map(str, self.node_dirs))
        own: list[psutil.Process] = []
        for proc in psutil.process_iter(["cmdline"]):
            cmd = " ".join(proc.info["cmdline"] or [])
            if any(m in cmd for m in marks):
                own.append(proc)
        family = {p.pid: p for p in own}
        for p in own:
            with contextlib.suppress(psutil.NoSuchProcess):
                family.update({c.pid: c for c in p.children(recursive=True)})
        procs = list(family.values())
        for p in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.terminate()
        _, alive = psutil.wait_procs(procs, timeout=5)
        for p in alive:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        psutil.wait_procs(alive, timeout=5)


def _node_args(ports: list[int]) -> list[str]:
    names = ("--node-manager-port", "--object-manager-port", "--metrics-export-port",
             "--dashboard-agent-listen-port", "--dashboard-agent-grpc-port", "--runtime-env-agent-port")
    args = [x for name, port in zip(names, ports, strict=False) for x in (name, str(port))]
    base = ports[len(names)]
    return [*args, "--min-worker-port", str(base), "--max-worker-port", str(base + 40),
            "--node-ip-address", "127.0.0.1", "--disable-usage-stats"]


def _worker_port_base() -> int:
    """A run of 41 ports (per node) that nothing listens on now, away from the ephemeral range."""
    for base in range(20000 + secrets.randbelow(200) * 50, 30000, 50):
        taken = {c.laddr.port for c in psutil.net_connections("inet") if c.laddr}
        if not taken & set(range(base, base + 150)):
            return base
    raise RuntimeError("no free worker port range")


def _start_head(cluster: RayCluster, client_port: int, ports: list[int]) -> str:
    """``ray start --head``, waited on until the head node is ALIVE; started once more if it never is.

    ``ray start --head`` gives its raylet 30 s to register and then exits 1. On a loaded machine the raylet
    usually registers a little later (waited out here), but now and then the head's processes are gone
    with it ("No node info found for head node"): then this cluster's processes are stopped and the
    head started again."""
    head_output = ""
    for _ in range(2):
        head = cluster.run(
            RAY, "start", "--head", "--temp-dir", str(cluster.temp_dir), "--port", str(cluster.gcs_port),
            "--dashboard-host", "127.0.0.1", "--dashboard-port", cluster.dashboard.rsplit(":", 1)[1],
            "--ray-client-server-port", str(client_port), "--num-cpus", "1",
            "--resources", json.dumps({"ingress": 1, "prefill_node": 1}),
            "--labels", "pdserve-role=prefill_node", *_node_args(ports))
        head_output = head.stdout[-2000:] + head.stderr[-2000:]
        assert head.returncode == 0 or LATE_RAYLET in head_output, head_output
        if _wait_alive(cluster, {"prefill_node"}, deadline=time.monotonic() + 90):
            return head_output
        cluster.kill_own_processes()
    raise AssertionError(f"the head node never came up, twice: {head_output}")


def _wait_alive(cluster: RayCluster, resources: set[str], deadline: float) -> bool:
    """Whether nodes offering every one of ``resources`` are ALIVE before ``deadline``."""
    while time.monotonic() < deadline:
        try:
            alive = [n for n in cluster.state()["nodes"] if n["state"] == "ALIVE"]
        except AssertionError:  # the head's dashboard is not answering (yet)
            alive = []
        if resources <= {r for n in alive for r in n["resources"]}:
            return True
        time.sleep(2.0)
    return False


def _start_node(cluster: RayCluster, resource: str, port_base: int) -> str:
    """A worker node offering ``resource`` (and the label ``pdserve-role=<resource>``), in its own temp dir,
    waited on until ALIVE; started once more, on fresh ports, if it never is.

    Like the head, a worker's ``ray start`` gives its raylet 30 s to register. On a loaded machine the
    raylet may register later (waited out here) or be gone with the failed ``ray start``: then that
    node's processes (found by its temp dir) are stopped and the node started again. Its workers take
    ports ``port_base + 50`` on, then ``port_base + 100`` on (``_worker_port_base`` checks 150)."""
    output = ""
    for attempt in (1, 2):
        node_dir = Path(tempfile.mkdtemp(prefix="pdn", dir="/tmp"))
        cluster.node_dirs.append(node_dir)
        node = cluster.run(RAY, "start", "--address", f"127.0.0.1:{cluster.gcs_port}", "--num-cpus", "1",
                           "--temp-dir", str(node_dir), "--resources", json.dumps({resource: 1}),
                           "--labels", f"pdserve-role={resource}",
                           *_node_args([*_free_ports(6), port_base + 50 * attempt]))
        output = node.stdout[-1500:] + node.stderr[-1500:]
        assert node.returncode == 0 or LATE_RAYLET in output, output
        if _wait_alive(cluster, {resource}, deadline=time.monotonic() + 120):
            return output
        cluster.kill_own_processes((str(node_dir),))
    raise AssertionError(f"the {resource} node never came up, twice: {output}")


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[RayCluster]:
    temp_dir = Path(tempfile.mkdtemp(prefix="pdr", dir="/tmp"))
    gcs, dash, client, *node_ports = _free_ports(3 + 6)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(16), RAY_DEDUP_LOGS="0",
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}")
    cluster = RayCluster(temp_dir, gcs, f"http://127.0.0.1:{dash}", env)
    try:
        base = _worker_port_base()
        head_output = _start_head(cluster, client, [*node_ports, base])
        node_output = _start_node(cluster, "decode_node", base)
        assert _wait_alive(cluster, {"prefill_node", "decode_node"}, deadline=time.monotonic() + 60), (
            head_output, node_output)
        yield cluster
    finally:
        cluster.kill_own_processes()
        for path in (temp_dir, *cluster.node_dirs):
            shutil.rmtree(path, ignore_errors=True)


@dataclass
class Job:
    job_id: str
    url: str


@pytest.fixture(scope="module")
def job(ray_cluster: RayCluster, default_model_path: Path) -> Iterator[Job]:
    port = _free_ports(1)[0]
    job_id = f"pdserve-test-{secrets.token_hex(4)}"
    submit = ray_cluster.run(
        RAY, "job", "submit", "--address", ray_cluster.dashboard, "--submission-id", job_id, "--no-wait",
        "--working-dir", str(ROOT), "--entrypoint-resources", json.dumps({"ingress": 1}), "--",
        "python", "-m", "cli.main", "serve", "--address", "auto", "--model", str(default_model_path),
        "--host", "127.0.0.1", "--port", str(port), "--num-prefill", "1", "--num-decode", "1",
        "--prefill-resources", "prefill_node=1", "--decode-resources", "decode_node=1",
        "--decode-labels", "pdserve-role=decode_node",
        "--worker-cpus", "1", "--torch-threads", "1", "--kv-cache-memory", "64M", "--linear-kernel", "plain",
        "--served-model-name", "tiny")
    assert submit.returncode == 0, submit.stdout[-2000:] + submit.stderr[-2000:]
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 240
    # /health every 0.5 s; `ray job status` (a CLI process importing Ray, seconds of CPU taken from the
    # starting workers on 2 cores) every 5 s only, to fail early when the job ended without serving
    status_due = time.monotonic() + 5.0
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        now = time.monotonic()
        if now >= status_due or now > deadline:
            status = ray_cluster.job_status(job_id)
            if any(s in status for s in ("FAILED", "STOPPED", "SUCCEEDED")) or now > deadline:
                pytest.fail(f"pdserve job not healthy:\n{status}\n{ray_cluster.job_logs(job_id)}")
            status_due = time.monotonic() + 5.0
        time.sleep(0.5)
    yield Job(job_id, url)
    ray_cluster.run(RAY, "job", "stop", "--address", ray_cluster.dashboard, job_id)


def _alive_workers(state: dict[str, Any]) -> list[dict[str, Any]]:
    return [a for a in state["actors"] if a["class_name"] in ROLES and a["state"] != "DEAD"]


def test_job_places_prefill_and_decode_on_their_nodes(ray_cluster: RayCluster, job: Job,
                                                      default_model_path: Path) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 6,
            "temperature": 0, "ignore_eos": True}
    resp = httpx.post(f"{job.url}/v1/chat/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] == 6
    state = ray_cluster.state()
    actors = _alive_workers(state)
    assert sorted(a["class_name"] for a in actors) == ["DecodeWorker", "PrefillWorker"]
    nodes = {n["node_id"]: n for n in state["nodes"]}
    placed = {a["class_name"]: a["node_id"] for a in actors}
    assert placed["PrefillWorker"] != placed["DecodeWorker"]
    for cls, resource in ROLES.items():
        assert resource in nodes[placed[cls]]["resources"], (cls, nodes[placed[cls]])
    assert all(a["state"] == "ALIVE" for a in actors)
    stats = httpx.get(f"{job.url}/v1/workers", timeout=10).json()["workers"]
    assert {w["pid"] for w in stats} == {a["pid"] for a in actors}  # the router talks to those actors
    plan = make_plan(read_model_config(default_model_path), dtype="float32", kv_cache_memory=64 * 1024**2)
    assert [w["kv"]["num_blocks"] for w in stats] == [plan.num_kv_blocks] * 2  # pdserve plan == the engines
    assert sum(g["state"] == "CREATED" for g in state["groups"]) == 2  # one placement group per worker


def test_job_stop_leaves_nothing_behind(ray_cluster: RayCluster, job: Job) -> None:
    stop = ray_cluster.run(RAY, "job", "stop", "--address", ray_cluster.dashboard, job.job_id)
    assert stop.returncode == 0, stop.stdout[-2000:] + stop.stderr[-2000:]
    deadline = time.monotonic() + 60
    while True:
        state = ray_cluster.state()
        left = _alive_workers(state) + [g for g in state["groups"] if g["state"] != "REMOVED"]
        if not left:
            break
        assert time.monotonic() < deadline, left
        time.sleep(1.0)
    assert "stopped" in ray_cluster.job_status(job.job_id).lower()
    logs = ray_cluster.job_logs(job.job_id)
    assert "pdserve: stopped" in logs, logs  # SIGTERM from the job supervisor: the clean shutdown ran
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{job.url}/health", timeout=2)

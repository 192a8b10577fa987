"""``pdserve serve``: Ray, the prefill and decode workers, and the OpenAI HTTP router in one command.

The command starts a local Ray instance (or attaches to ``--address``), starts
the workers (they load the model in their own processes), and runs uvicorn on
``--host:--port`` in this process, which loads only the tokenizer. ``/health``
answers 503 until every worker has loaded and connected, then 200, and one line
``pdserve: serving <model> on http://host:port (P prefill, D decode)`` is logged.
SIGINT or SIGTERM stops uvicorn, kills the actors and shuts down the Ray instance
this command started.

On a cluster (``--address auto``, e.g. as the entrypoint of ``ray job submit``)
the router runs where this command runs (the head node, or the node
``--entrypoint-resources`` picks) and each worker reserves a placement group on
a node offering ``--prefill-resources`` / ``--decode-resources``, one GPU per
worker with ``--device cuda``. A worker whose process dies is restarted by Ray
up to ``--max-restarts`` times and re-registered by the client. ``ray job stop``
sends SIGTERM: the same clean shutdown; the actors and placement groups belong
to this driver, so nothing outlives it even when it is killed outright.
Settings may come from ``--config FILE.yaml`` (flags override it); the
effective configuration is logged at start. Everything here reads one frozen
``cluster.config.ServeConfig``, built by the CLI (or the Ray Serve builder).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import os
import signal
import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cluster.config import ServeConfig, describe
from telemetry.tracing import TraceConfig, Tracing

if TYPE_CHECKING:
    from fastapi import FastAPI

    from cluster.fleet import Fleet
    from cluster.planning import PlannerLoop
    from cluster.workers import WorkerGroup
    from engine.config import EngineConfig
    from engine.loader import ModelSource
    from engine.tokenizer import Tokenizer
    from planner.live import LivePlanner
    from router.client import PDClient
    from router.config import RouterConfig
    from router.drain import DrainReport

log = logging.getLogger("pdserve")
READY_TIMEOUT = 600.0


def serving_max_model_len(source: ModelSource, config: EngineConfig) -> int:
    """The context length the workers will enforce: the model's (or --max-model-len), capped by KV room."""
    from engine.kv_sizing import num_kv_blocks

    limit = config.max_model_len or source.config.max_position_embeddings
    if config.num_kv_blocks is not None or not config.device.startswith("cuda"):
        limit = min(limit, num_kv_blocks(source.config, config) * config.block_size)
    return limit


def _start_ray(config: ServeConfig) -> bool:
    """Start or attach to Ray; True when this process started the instance."""
    import ray

    if config.address is not None:  # the workers set their own env; a job's runtime_env stays as submitted
        ray.init(address=config.address, log_to_driver=True)
        return False
    otel = {k: v for k, v in os.environ.items() if k.startswith("OTEL_")}
    env = {"env_vars": {"OMP_NUM_THREADS": str(config.decode.threads), **otel}}
    needed = config.num_prefill * config.prefill.num_cpus + config.num_decode * config.decode.num_cpus
    cpus = max(os.cpu_count() or 1, math.ceil(needed))
    ray.init(address="local", num_cpus=cpus, include_dashboard=False, runtime_env=env, log_to_driver=True)
    return True


def _local_ray_stopped() -> bool:
    """Whether a process of the local Ray this process started has exited: a signal to the whole process
    group (Ctrl-C in a terminal, ``timeout``) reaches its raylet and GCS too, which take the workers with
    them, and asking them to stop the workers would only wait out the timeouts."""
    from ray._private import worker

    node = worker._global_node
    try:
        return node is not None and not node.remaining_processes_alive()
    except Exception:  # noqa: BLE001 - Ray's private API moved: take the long way
        return False


def _kill_local_ray() -> None:
    """SIGKILL what is left of the local Ray once a process of it has exited, so that ``ray.shutdown``
    does not ask the dead GCS, then wait on each survivor, for seconds."""
    from ray._private import worker

    node = worker._global_node
    with contextlib.suppress(Exception):  # Ray's private API moved: ray.shutdown takes the long way
        if node is not None:
            node.kill_all_processes(check_alive=False, allow_graceful=False, wait=True)


def _exit_on_signal(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


def listen_socket(host: str, port: int) -> socket.socket:
    """The router's listening socket, bound before Ray and the workers start. Holding it from the first
    second means a port another process holds is refused at once (ValueError naming ``--port``, exit 2),
    not after the workers have loaded, and that no connection Ray opens while they load can take it."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family)
    except OSError as exc:
        reason = os.strerror(exc.errno) if exc.errno else str(exc)
        raise ValueError(f"--port {port} (--host {host}): {reason}") from exc


async def _serve(server: Any, service: Service, ready_line: str, listener: socket.socket) -> bool:
    """Run uvicorn on ``listener`` until a signal; connect the workers meanwhile. False when the
    workers never came up."""
    failed: list[BaseException] = []

    async def bring_up() -> None:
        try:
            await service.start(READY_TIMEOUT)
        except Exception as exc:
            failed.append(exc)
            log.error("pdserve: workers failed to start: %s: %s", type(exc).__name__, exc)
            server.should_exit = True
            return
        log.info(ready_line)

    async with asyncio.TaskGroup() as tasks:  # bring_up answers its own failure: it never fails the group
        up = tasks.create_task(bring_up())
        await server.serve(sockets=[listener])
        up.cancel()  # a signal while the workers still load: stop waiting for them
    if service.planner is not None:
        await service.planner.stop()
    return not failed


@dataclass
class Prepared:
    """What the router needs before any worker exists (no Ray yet): model, configs, tokenizer, tracing."""

    model_path: str
    engine_config: EngineConfig
    router_config: RouterConfig
    tokenizer: Tokenizer
    trace_config: TraceConfig
    tracing: Tracing
    planner: LivePlanner | None = None  # --planner: its rule, the profile read


@dataclass
class Service:
    """One router's serving stack on Ray: the worker actors, the PD client over them and the HTTP app.

    ``start`` waits for the workers (then starts the planner, if any); ``stop`` kills them and removes
    their placement groups. While serving, ``add_worker`` and ``drain_worker`` change the split (the
    Python face of what the planner and ``POST /v1/workers/{id}/drain`` do)."""

    app: FastAPI
    client: PDClient
    group: WorkerGroup
    prepared: Prepared
    fleet: Fleet
    planner: PlannerLoop | None = None

    async def start(self, timeout: float = READY_TIMEOUT) -> None:
        await self.client.start(timeout)
        if self.planner is not None:
            self.planner.start()

    async def add_worker(self, role: str) -> str:
        """Start one more ``prefill`` or ``decode`` worker and let it join routing; its id."""
        return await self.fleet.add(role)

    async def drain_worker(self, worker_id: str, deadline_s: float = 60.0) -> DrainReport:
        """Take a worker out of routing now, let it finish, free its KV and leases, remove it."""
        return await self.fleet.drain(worker_id, deadline_s)

    def stop(self) -> bool:
        """Flush the workers' traces, kill the actors, remove the placement groups (bounded, see
        ``WorkerGroup.shutdown``); False when Ray did not confirm in time."""
        import ray

        if self.prepared.tracing.enabled:
            with contextlib.suppress(Exception):  # a dead worker has nothing left to flush
                ray.get([a.flush_traces.remote() for a in self.group.all()], timeout=10)
        return self.group.shutdown()


def prepare_service(config: ServeConfig) -> Prepared:
    """Resolve and read the model (config and tokenizer only) and finish the router's config with what
    the model decides (its name, its context length) and what this process's environment says (the API
    key, the ``OTEL_*`` tracing variables)."""
    from engine.loader import load_model_source, resolve_model
    from router.config import RouterConfig

    path = resolve_model(config.model)
    source = load_model_source(path)
    settings = dataclasses.replace(config.router,
                                   api_key=config.router.api_key or os.environ.get("PDSERVE_API_KEY") or None)
    router_config = RouterConfig(model_name=config.served_model_name or Path(path).stem,
                                 max_model_len=serving_max_model_len(source, config.engine),
                                 **dataclasses.asdict(settings))
    trace_config = config.tracing.resolve()
    planner = None
    if config.planner.enabled:
        from cluster.planning import make_planner

        planner = make_planner(config.planner, config.num_prefill, config.num_decode)
    return Prepared(str(path), config.engine, router_config, source.load_tokenizer(), trace_config,
                    Tracing(trace_config, "router"), planner)


def launch_service(config: ServeConfig, prepared: Prepared) -> Service:
    """Start the worker actors (each in its own placement group) on the connected Ray and build the app
    over them; the workers are still loading when this returns (``Service.start`` waits for them)."""
    from cluster.fleet import Fleet
    from cluster.workers import start_workers
    from router.app import create_app
    from router.client import PDClient

    group = start_workers(prepared.model_path, config.engine, config.num_prefill, config.num_decode,
                          config.prefill, config.decode, lease_seconds=config.lease_seconds,
                          tracing=prepared.trace_config,
                          transfer_failure_rate=config.inject_transfer_failures,
                          share_cores=config.share_cores)
    try:
        client = PDClient(group.prefill, group.decode, config.client, colocated=config.colocated)
        fleet = Fleet(group, client)
        planner = None
        if prepared.planner is not None:
            from cluster.planning import PlannerLoop

            planner = PlannerLoop(config.planner, prepared.planner, fleet, prepared.tracing)
        registries = [planner.metrics.registry] if planner is not None else []
        app = create_app(client, prepared.tokenizer, prepared.router_config, prepared.tracing, registries)
    except BaseException:
        group.shutdown()
        raise
    return Service(app, client, group, prepared, fleet, planner)


def run_serve(config: ServeConfig, config_file: str | None = None) -> int:
    """Serve until a signal; ``config_file`` (the ``--config`` file, if any) only names the settings'
    source in the start-up log."""
    config.check_local()
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    log.info("pdserve: configuration%s:\n%s", f" (from {config_file} and flags)" if config_file else "",
             describe(config))

    import ray
    import uvicorn

    import cluster.fleet  # noqa: F401
    import cluster.workers  # noqa: F401
    import router.app  # noqa: F401

    # Everything the router and the worker handles run is imported before Ray starts: under `ray job
    # submit` the job's copy of the working directory can be removed by a node's runtime-env agent
    # while the driver runs (several nodes sharing one temp dir), so nothing may be imported later.
    import router.client  # noqa: F401

    listener = listen_socket(config.host, config.port)  # before Ray: a taken port fails in a second
    prepared = prepare_service(config)
    started_ray = _start_ray(config)
    service = None
    try:
        for sig in (signal.SIGINT, signal.SIGTERM):  # while placing workers: unwind through `finally`
            signal.signal(sig, _exit_on_signal)
        service = launch_service(config, prepared)
        server = uvicorn.Server(uvicorn.Config(service.app, host=config.host, port=config.port,
                                               log_level="warning", access_log=False,
                                               timeout_graceful_shutdown=5))
        for sig in (signal.SIGINT, signal.SIGTERM):  # uvicorn re-raises the signal it caught on exit
            signal.signal(sig, lambda *_: None)
        where = f"http://{config.host}:{config.port}"
        ready = (f"pdserve: serving {prepared.router_config.model_name} on {where} "
                 f"({config.num_prefill} prefill, {config.num_decode} decode)")
        ok = asyncio.run(_serve(server, service, ready, listener))
        return 0 if ok else 1
    finally:
        listener.close()
        ray_stopped = started_ray and _local_ray_stopped()
        if ray_stopped:
            log.warning("pdserve: the local Ray stopped with this process group; its workers stopped with it")
        elif service is not None:
            service.stop()
        prepared.tracing.shutdown()
        if ray_stopped:
            _kill_local_ray()
        if started_ray:
            ray.shutdown()
        log.info("pdserve: stopped")

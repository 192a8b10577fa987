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
effective configuration is logged at start.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import math
import os
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cluster.argtypes import number, parsed_by, positive
from cluster.cli import add_engine_args, check_engine_kwargs, engine_kwargs_from_args, size
from router.policy import POLICIES as POLICIES_ROUTING
from transfer.tracing import PROTOCOLS, TraceConfig, Tracing

if TYPE_CHECKING:
    from fastapi import FastAPI

    from cluster.backend import ClusterBackend
    from cluster.cli import EngineKwargs
    from cluster.workers import WorkerGroup
    from engine.config import EngineConfig
    from engine.loader import ModelSource
    from engine.tokenizer import Tokenizer
    from router.app import RouterConfig

log = logging.getLogger("pdserve")
READY_TIMEOUT = 600.0
POLICIES = ("retry", "recompute", "fail")


_positive = positive
_non_negative = number(int, lambda v: v >= 0, ">= 0")
_ratio = number(float, lambda v: 0.0 <= v <= 1.0, "within [0, 1]")


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    """The flags of ``pdserve serve`` (the engine flags included)."""
    g = parser.add_argument_group("server")
    g.add_argument("--config", default=None, metavar="FILE",
                   help="YAML file of settings keyed by flag name (e.g. 'num-decode: 2'); flags given on "
                        "the command line override it")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    g.add_argument("--port", type=int, default=8000, help="port to listen on (default: 8000)")
    g.add_argument("--api-key", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on every endpoint but /health "
                        "(default: $PDSERVE_API_KEY, else no key)")
    g.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="the model name clients send (default: the model file or folder name)")
    g.add_argument("--max-request-bytes", type=size, default=1024**2, metavar="SIZE",
                   help="largest request body, e.g. 1M (default: 1M); larger ones get 413")
    g.add_argument("--max-queued-requests", type=_positive(int), default=256, metavar="N",
                   help="requests waiting for their first token before new ones get 503 (default: 256)")
    g.add_argument("--max-queued-tokens", type=_positive(int), default=None, metavar="N",
                   help="prompt tokens waiting for their first token before new requests get 503 "
                        "(default: no limit)")
    g.add_argument("--request-timeout", type=_positive(float), default=600.0, metavar="SECONDS",
                   help="abort a request (408) that has not finished after this long (default: 600)")
    g.add_argument("--default-max-tokens", type=_positive(int), default=None, metavar="N",
                   help="max_tokens when a request gives none (default: up to the context length)")
    c = parser.add_argument_group("cluster")
    c.add_argument("--num-prefill", type=int, default=1, metavar="N",
                   help="prefill workers; 0 runs prompts on the decode workers (default: 1)")
    c.add_argument("--num-decode", type=int, default=1, metavar="N", help="decode workers (default: 1)")
    c.add_argument("--address", default=None, metavar="ADDR",
                   help="Ray cluster to attach to: 'auto' (the cluster of this node, or the job's under "
                        "ray job submit) or HOST:PORT (default: start a local Ray instance)")
    c.add_argument("--kv-failure-policy", choices=POLICIES, default="retry",
                   help="when a prefill worker or a KV transfer fails: retry on another prefill worker, "
                        "recompute on decode, or fail the request (default: retry)")
    c.add_argument("--routing", choices=POLICIES_ROUTING, default="prefix",
                   help="how workers are chosen: prefix (cached prefix blocks, load, free KV, transfer "
                        "size), round-robin or least-loaded (default: prefix)")
    c.add_argument("--disagg-min-tokens", type=_non_negative, default=0, metavar="N",
                   help="prompts whose uncached part is shorter than N tokens prefill on the decode "
                        "worker (default: 0, always disaggregate when prefill workers exist)")
    c.add_argument("--prefill-saturation-tokens", type=_positive(int), default=32768, metavar="N",
                   help="while every prefill worker has more than N prompt tokens in flight, new "
                        "prompts prefill on the decode worker (default: 32768)")
    c.add_argument("--migration-limit", type=_non_negative, default=1, metavar="N",
                   help="times a stream moves to another decode worker when its worker dies (default: 1)")
    c.add_argument("--lease-seconds", type=_positive(float), default=30.0, metavar="SECONDS",
                   help="how long prefill keeps KV blocks for decode to pull (default: 30)")
    c.add_argument("--worker-cpus", type=_positive(float), default=1.0, metavar="N",
                   help="Ray CPUs reserved by each worker; with --device cuda each also reserves one "
                        "GPU (default: 1)")
    c.add_argument("--torch-threads", type=_positive(int), default=1, metavar="N",
                   help="torch threads in each worker (default: 1)")
    c.add_argument("--prefill-resources", type=_resources("--prefill-resources"), default={},
                   metavar="NAME=N[,...]",
                   help="Ray custom resources each prefill worker needs, e.g. prefill_node=1: prefill runs "
                        "only on nodes started with them (default: none)")
    c.add_argument("--decode-resources", type=_resources("--decode-resources"), default={},
                   metavar="NAME=N[,...]",
                   help="Ray custom resources each decode worker needs, e.g. decode_node=1 (default: none)")
    c.add_argument("--prefill-labels", type=_labels("--prefill-labels"), default={},
                   metavar="KEY=VALUE[,...]",
                   help="Ray node labels prefill workers must run on (ray start --labels), e.g. "
                        "pdserve-role=prefill (default: none)")
    c.add_argument("--decode-labels", type=_labels("--decode-labels"), default={},
                   metavar="KEY=VALUE[,...]",
                   help="Ray node labels decode workers must run on, e.g. pdserve-role=decode "
                        "(default: none)")
    c.add_argument("--prefill-tp", type=_tp("--prefill-tp"), default=1, metavar="N",
                   help="devices per prefill worker (tensor parallelism); only 1 is supported so far")
    c.add_argument("--decode-tp", type=_tp("--decode-tp"), default=1, metavar="N",
                   help="devices per decode worker (tensor parallelism); only 1 is supported so far")
    c.add_argument("--max-restarts", type=_non_negative, default=3, metavar="N",
                   help="times Ray restarts a worker whose process died; it then rejoins (default: 3)")
    c.add_argument("--placement-timeout", type=_positive(float), default=300.0, metavar="SECONDS",
                   help="fail when a worker's resources cannot be reserved within this long (default: 300)")
    t = parser.add_argument_group("telemetry")
    t.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                   help="send OpenTelemetry traces over OTLP here, e.g. http://127.0.0.1:4318/v1/traces "
                        "(http/protobuf) or 127.0.0.1:4317 (grpc) "
                        "(default: $OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, "
                        "else $OTEL_EXPORTER_OTLP_ENDPOINT, else no tracing)")
    t.add_argument("--otlp-traces-protocol", choices=PROTOCOLS, default=None,
                   help="OTLP transport (default: $OTEL_EXPORTER_OTLP_TRACES_PROTOCOL, else http/protobuf)")
    t.add_argument("--otlp-traces-sample-ratio", type=_ratio, default=None, metavar="RATIO",
                   help="fraction of requests traced, 0..1 (default: $OTEL_TRACES_SAMPLER_ARG, else 1.0)")
    add_engine_args(parser)


def _resources(flag: str) -> Any:
    from cluster.placement import parse_resources

    return parsed_by(parse_resources, flag)


def _labels(flag: str) -> Any:
    from cluster.placement import parse_labels

    return parsed_by(parse_labels, flag)


def _tp(flag: str) -> Any:
    def convert(text: str) -> int:
        value = _positive(int)(text)
        if value != 1:
            raise argparse.ArgumentTypeError(f"{value}: tensor parallelism is not implemented yet; use 1")
        return int(value)

    return convert


def serving_max_model_len(source: ModelSource, config: EngineConfig) -> int:
    """The context length the workers will enforce: the model's (or --max-model-len), capped by KV room."""
    from engine.kv_sizing import num_kv_blocks

    limit = config.max_model_len or source.config.max_position_embeddings
    if config.num_kv_blocks is not None or not config.device.startswith("cuda"):
        limit = min(limit, num_kv_blocks(source.config, config) * config.block_size)
    return limit


def _start_ray(args: argparse.Namespace) -> bool:
    """Start or attach to Ray; True when this process started the instance."""
    import ray

    if args.address is not None:  # the workers set their own env; a job's runtime_env stays as submitted
        ray.init(address=args.address, log_to_driver=True)
        return False
    otel = {k: v for k, v in os.environ.items() if k.startswith("OTEL_")}
    env = {"env_vars": {"OMP_NUM_THREADS": str(args.torch_threads), **otel}}
    workers = args.num_prefill + args.num_decode
    cpus = max(os.cpu_count() or 1, math.ceil(workers * args.worker_cpus))
    ray.init(address="local", num_cpus=cpus, include_dashboard=False, runtime_env=env, log_to_driver=True)
    return True


def _exit_on_signal(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


async def _serve(server: Any, backend: ClusterBackend, ready_line: str) -> bool:
    """Run uvicorn until a signal; connect the workers meanwhile. False when the workers never came up."""
    failed: list[BaseException] = []

    async def bring_up() -> None:
        try:
            await backend.start(READY_TIMEOUT)
        except Exception as exc:
            failed.append(exc)
            log.error("pdserve: workers failed to start: %s: %s", type(exc).__name__, exc)
            server.should_exit = True
            return
        log.info(ready_line)

    task = asyncio.create_task(bring_up())
    await server.serve()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    return not failed


def check_serve_args(args: argparse.Namespace, on_cluster: bool = False) -> EngineKwargs:
    """The checks argparse cannot make alone; raises ValueError naming the flag. ``on_cluster``: Ray
    is already there (a Ray Serve application), so node selectors need no ``--address``."""
    kwargs = engine_kwargs_from_args(args)
    check_engine_kwargs(kwargs)
    if args.num_decode < 1 or args.num_prefill < 0:
        raise ValueError("--num-decode must be >= 1 and --num-prefill >= 0")
    if args.address is None and not on_cluster:
        for flag in ("--prefill-resources", "--decode-resources", "--prefill-labels", "--decode-labels"):
            if getattr(args, flag[2:].replace("-", "_")):
                raise ValueError(f"{flag} selects nodes of a Ray cluster: give its --address (e.g. auto); "
                                 "the local instance pdserve starts has no custom resources or labels")
    return kwargs


@dataclass
class Prepared:
    """What the router needs before any worker exists (no Ray yet): model, configs, tokenizer, tracing."""

    model_path: str
    engine_config: EngineConfig
    router_config: RouterConfig
    tokenizer: Tokenizer
    trace_config: TraceConfig
    tracing: Tracing


@dataclass
class Service:
    """One router's serving stack on Ray: the worker actors, the backend over them and the HTTP app.

    ``start`` waits for the workers; ``stop`` kills them and removes their placement groups."""

    app: FastAPI
    backend: ClusterBackend
    group: WorkerGroup
    prepared: Prepared

    async def start(self, timeout: float = READY_TIMEOUT) -> None:
        await self.backend.start(timeout)

    def stop(self) -> bool:
        """Flush the workers' traces, kill the actors, remove the placement groups (bounded, see
        ``WorkerGroup.shutdown``); False when Ray did not confirm in time."""
        import ray

        if self.prepared.tracing.enabled:
            with contextlib.suppress(Exception):  # a dead worker has nothing left to flush
                ray.get([a.flush_traces.remote() for a in self.group.all()], timeout=10)
        return self.group.shutdown()


def prepare_service(args: argparse.Namespace, kwargs: EngineKwargs) -> Prepared:
    """Resolve and read the model (config and tokenizer only) and build the engine and router configs."""
    from engine.config import EngineConfig
    from engine.loader import load_model_source, resolve_model
    from router.app import RouterConfig

    path = resolve_model(kwargs["model"])
    source = load_model_source(path)
    engine_config = EngineConfig(
        dtype=kwargs["dtype"], device=kwargs["device"], block_size=kwargs["block_size"],
        kv_cache_memory=kwargs["kv_cache_memory"], num_kv_blocks=kwargs["num_kv_blocks"],
        enable_prefix_caching=kwargs["enable_prefix_caching"],
        max_num_batched_tokens=kwargs["max_num_batched_tokens"], max_num_seqs=kwargs["max_num_seqs"],
        max_model_len=kwargs["max_model_len"], seed=kwargs["seed"], kv_cache_dtype=kwargs["kv_cache_dtype"],
        preemption_mode=kwargs["preemption_mode"], swap_space=kwargs["swap_space"],
        kv_offload_bytes=kwargs["kv_offload_bytes"], kv_offload_dir=kwargs["kv_offload_dir"],
        kv_offload_disk_bytes=kwargs["kv_offload_disk_bytes"],
        kv_sinks=kwargs["kv_sinks"], kv_window=kwargs["kv_window"])
    router_config = RouterConfig(
        model_name=args.served_model_name or Path(path).stem,
        max_model_len=serving_max_model_len(source, engine_config),
        api_key=args.api_key or os.environ.get("PDSERVE_API_KEY") or None,
        max_request_bytes=args.max_request_bytes, max_queued_requests=args.max_queued_requests,
        max_queued_tokens=args.max_queued_tokens, request_timeout=args.request_timeout,
        default_max_tokens=args.default_max_tokens)
    trace_config = TraceConfig.from_env(args.otlp_traces_endpoint, args.otlp_traces_protocol,
                                        args.otlp_traces_sample_ratio)
    return Prepared(str(path), engine_config, router_config, source.load_tokenizer(), trace_config,
                    Tracing(trace_config, "router"))


def launch_service(args: argparse.Namespace, prepared: Prepared) -> Service:
    """Start the worker actors (each in its own placement group) on the connected Ray and build the app
    over them; the workers are still loading when this returns (``Service.start`` waits for them)."""
    from cluster.backend import ClusterBackend
    from cluster.client import ClientConfig, KvFailurePolicy, PDClient
    from cluster.workers import WorkerOptions, start_workers
    from router.app import create_app

    gpus = 1 if prepared.engine_config.device.startswith("cuda") else 0
    common = {"num_cpus": args.worker_cpus, "num_gpus": gpus, "torch_threads": args.torch_threads,
              "max_restarts": args.max_restarts, "placement_groups": True,
              "placement_timeout": args.placement_timeout}
    popts = WorkerOptions(resources=args.prefill_resources, labels=args.prefill_labels,
                          tp=args.prefill_tp, resources_flag="--prefill-resources", **common)
    dopts = WorkerOptions(resources=args.decode_resources, labels=args.decode_labels,
                          tp=args.decode_tp, resources_flag="--decode-resources", **common)
    group = start_workers(prepared.model_path, prepared.engine_config, args.num_prefill, args.num_decode,
                          popts, dopts, lease_seconds=args.lease_seconds, tracing=prepared.trace_config)
    try:
        client = PDClient(group.prefill, group.decode, ClientConfig(
            kv_failure_policy=KvFailurePolicy(args.kv_failure_policy), routing=args.routing,
            disagg_min_tokens=args.disagg_min_tokens,
            prefill_saturation_tokens=args.prefill_saturation_tokens,
            migration_limit=args.migration_limit))
        name = prepared.router_config.model_name
        backend = ClusterBackend(client, name, colocated=args.num_prefill == 0)
        app = create_app(backend, prepared.tokenizer, prepared.router_config, prepared.tracing)
    except BaseException:
        group.shutdown()
        raise
    return Service(app, backend, group, prepared)


def run_serve(args: argparse.Namespace) -> int:
    kwargs = check_serve_args(args)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    from cluster.config import describe

    log.info("pdserve: configuration%s:\n%s", f" (from {args.config} and flags)" if args.config else "",
             describe(args))

    import ray
    import uvicorn

    # Everything the router and the worker handles run is imported before Ray starts: under `ray job
    # submit` the job's copy of the working directory can be removed by a node's runtime-env agent
    # while the driver runs (several nodes sharing one temp dir), so nothing may be imported later.
    import cluster.backend  # noqa: F401
    import cluster.client  # noqa: F401
    import cluster.workers  # noqa: F401
    import router.app  # noqa: F401

    prepared = prepare_service(args, kwargs)
    started_ray = _start_ray(args)
    service = None
    try:
        for sig in (signal.SIGINT, signal.SIGTERM):  # while placing workers: unwind through `finally`
            signal.signal(sig, _exit_on_signal)
        service = launch_service(args, prepared)
        server = uvicorn.Server(uvicorn.Config(service.app, host=args.host, port=args.port,
                                               log_level="warning", access_log=False,
                                               timeout_graceful_shutdown=5))
        for sig in (signal.SIGINT, signal.SIGTERM):  # uvicorn re-raises the signal it caught on exit
            signal.signal(sig, lambda *_: None)
        ready = (f"pdserve: serving {prepared.router_config.model_name} on http://{args.host}:{args.port} "
                 f"({args.num_prefill} prefill, {args.num_decode} decode)")
        ok = asyncio.run(_serve(server, service.backend, ready))
        return 0 if ok else 1
    finally:
        if service is not None:
            service.stop()
        prepared.tracing.shutdown()
        if started_ray:
            ray.shutdown()
        log.info("pdserve: stopped")

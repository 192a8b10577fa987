"""``pdserve serve``: Ray, the prefill and decode workers, and the OpenAI HTTP router in one command.

The command starts a local Ray instance (or attaches to ``--address``), starts
the workers (they load the model in their own processes), and runs uvicorn on
``--host:--port`` in this process, which loads only the tokenizer. ``/health``
answers 503 until every worker has loaded and connected, then 200, and one line
``pdserve: serving <model> on http://host:port (P prefill, D decode)`` is logged.
SIGINT or SIGTERM stops uvicorn, kills the actors and shuts down the Ray instance
this command started.
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
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cluster.cli import add_engine_args, check_engine_kwargs, engine_kwargs_from_args, parse_size
from router.policy import POLICIES as POLICIES_ROUTING

if TYPE_CHECKING:
    from cluster.backend import ClusterBackend
    from engine.config import EngineConfig
    from engine.loader import ModelSource

log = logging.getLogger("pdserve")
READY_TIMEOUT = 600.0
POLICIES = ("retry", "recompute", "fail")


def _positive(kind: type[int] | type[float]) -> Any:
    def convert(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid {kind.__name__} value: {text!r}") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"{text!r} must be > 0")
        return value

    return convert


def _non_negative(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be >= 0")
    return value


def _bytes(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    """The flags of ``pdserve serve`` (the engine flags included)."""
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    g.add_argument("--port", type=int, default=8000, help="port to listen on (default: 8000)")
    g.add_argument("--api-key", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on every endpoint but /health "
                        "(default: $PDSERVE_API_KEY, else no key)")
    g.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="the model name clients send (default: the model file or folder name)")
    g.add_argument("--max-request-bytes", type=_bytes, default=1024**2, metavar="SIZE",
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
                   help="Ray address to attach to, e.g. 'auto' (default: start a local Ray instance)")
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
                   help="Ray CPUs reserved by each worker (default: 1)")
    c.add_argument("--torch-threads", type=_positive(int), default=1, metavar="N",
                   help="torch threads in each worker (default: 1)")
    add_engine_args(parser)


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

    env = {"env_vars": {"OMP_NUM_THREADS": str(args.torch_threads)}}
    if args.address is not None:
        ray.init(address=args.address, runtime_env=env, log_to_driver=True)
        return False
    workers = args.num_prefill + args.num_decode
    cpus = max(os.cpu_count() or 1, math.ceil(workers * args.worker_cpus))
    ray.init(address="local", num_cpus=cpus, include_dashboard=False, runtime_env=env, log_to_driver=True)
    return True


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


def run_serve(args: argparse.Namespace) -> int:
    kwargs = engine_kwargs_from_args(args)
    check_engine_kwargs(kwargs)
    if args.num_decode < 1 or args.num_prefill < 0:
        raise ValueError("--num-decode must be >= 1 and --num-prefill >= 0")
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)

    import ray
    import uvicorn

    from cluster.backend import ClusterBackend
    from cluster.client import ClientConfig, KvFailurePolicy, PDClient
    from cluster.workers import WorkerOptions, start_workers
    from engine.config import EngineConfig
    from engine.loader import load_model_source, resolve_model
    from router.app import RouterConfig, create_app

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
        kv_sinks=kwargs["kv_sinks"], kv_window=kwargs["kv_window"])
    router_config = RouterConfig(
        model_name=args.served_model_name or Path(path).stem,
        max_model_len=serving_max_model_len(source, engine_config),
        api_key=args.api_key or os.environ.get("PDSERVE_API_KEY") or None,
        max_request_bytes=args.max_request_bytes, max_queued_requests=args.max_queued_requests,
        max_queued_tokens=args.max_queued_tokens, request_timeout=args.request_timeout,
        default_max_tokens=args.default_max_tokens)
    tokenizer = source.load_tokenizer()
    started_ray = _start_ray(args)
    actors: list[Any] = []
    try:
        opts = WorkerOptions(num_cpus=args.worker_cpus, torch_threads=args.torch_threads)
        group = start_workers(str(path), engine_config, args.num_prefill, args.num_decode, opts, opts,
                              lease_seconds=args.lease_seconds)
        actors = group.all()
        client = PDClient(group.prefill, group.decode, ClientConfig(
            kv_failure_policy=KvFailurePolicy(args.kv_failure_policy), routing=args.routing,
            disagg_min_tokens=args.disagg_min_tokens,
            prefill_saturation_tokens=args.prefill_saturation_tokens,
            migration_limit=args.migration_limit))
        backend = ClusterBackend(client, router_config.model_name, colocated=args.num_prefill == 0)
        app = create_app(backend, tokenizer, router_config)
        server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="warning",
                                               access_log=False, timeout_graceful_shutdown=5))
        for sig in (signal.SIGINT, signal.SIGTERM):  # uvicorn re-raises the signal it caught on exit
            signal.signal(sig, lambda *_: None)
        ready = (f"pdserve: serving {router_config.model_name} on http://{args.host}:{args.port} "
                 f"({args.num_prefill} prefill, {args.num_decode} decode)")
        ok = asyncio.run(_serve(server, backend, ready))
        return 0 if ok else 1
    finally:
        for actor in actors:
            with contextlib.suppress(Exception):  # already dead
                ray.kill(actor)
        if started_ray:
            ray.shutdown()
        log.info("pdserve: stopped")

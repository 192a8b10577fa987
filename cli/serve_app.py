"""pdserve as a Ray Serve application: the router of ``pdserve serve`` behind Ray Serve's HTTP proxy.

``build_app`` is the application builder a Serve config names (``import_path:
cli.serve_app:build_app``, e.g. in a KubeRay RayService's ``serveConfigV2``).
Its ``args`` are the settings of ``pdserve serve`` keyed as in its ``--config``
file (``num-decode: 2``, ``prefill-resources: {prefill_node: 1}``), plus
``config: FILE.yaml`` for a file of them that the other keys override. They go
through the same conversion and checks as the command line
(``cli.config_file.convert_settings``, ``cli.serve_config.serve_config_from_args``); a bad
key or value raises ``ConfigError`` naming the key and its flag, which Serve
reports as the application's deploy error. ``host``, ``port`` and ``address``
are refused: Serve's proxy listens where its ``http_options`` say, and the
application runs on the Ray cluster Serve runs on.

The application is one deployment, ``PdserveRouter``, with one replica (it owns
the workers, and the router's admission queue, prefix index and metrics live in
it; more replicas are refused). Its constructor starts the prefill and decode
workers exactly as ``pdserve serve`` does (``cluster.serve.launch_service``: a
placement group per worker on a node offering the role's resources or labels,
Ray restarts up to ``max-restarts``) and returns once every worker has loaded
and connected, so the application turns RUNNING only when it can serve and
``/health`` answers 200 from its first request. The HTTP app is the same
``router.app.create_app`` app: endpoints, errors, SSE streaming, ``/metrics``.

Deleting the application (``serve.delete``, ``serve.shutdown``, removing the
RayService) runs the replica's destructor, which stops the client and kills the
worker actors and removes their placement groups. Should the replica process
die instead, the actors it owns die with it and its placement groups go with the
(detached) replica actor.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping
from typing import Any

from ray import serve
from ray.serve import Application, Deployment

from cli.config_file import ConfigError, convert_settings, key_dest, load_config, subparser
from cli.serve_config import serve_config_from_args
from cluster.config import ServeConfig, describe
from cluster.serve import READY_TIMEOUT, Service, launch_service, prepare_service

WHERE = "Ray Serve application args"
DEPLOYMENT = "PdserveRouter"
# Settings of `pdserve serve` that Ray Serve owns under this application.
NOT_APPLICABLE = {
    "host": "Ray Serve's proxy listens on http_options.host",
    "port": "Ray Serve's proxy listens on http_options.port",
    "address": "the application runs on the Ray cluster Ray Serve runs on",
}
HEALTH_REQUESTS = 64  # room beyond generation requests for /health, /metrics, /v1/models...

log = logging.getLogger("ray.serve")


def serve_options(options: Mapping[str, Any] | None) -> ServeConfig:
    """Validate an application's ``args`` exactly as ``pdserve serve --config`` validates a file:
    their ``ServeConfig``, or ``ConfigError`` naming the key and flag."""
    from cli.main import build_parser

    if options is None:
        options = {}
    if not isinstance(options, Mapping):
        raise ConfigError(f"{WHERE} must be a mapping of flag names to values, got {type(options).__name__}")
    parser = build_parser()
    sub = subparser(parser, "serve")
    raw = dict(options)
    settings: dict[str, Any] = {}
    for key in [k for k in raw if key_dest(k) == "config"]:
        path = raw.pop(key)
        if not isinstance(path, str):
            raise ConfigError(f"{WHERE}: key {key!r} (--config) must be the path of a YAML file")
        settings.update(load_config(path, sub))
    settings.update(convert_settings(raw, sub, WHERE))
    for dest, reason in NOT_APPLICABLE.items():
        if dest in settings:
            raise ConfigError(f"{WHERE}: key {dest!r} (--{dest}) does not apply under Ray Serve: {reason}")
    sub.set_defaults(**settings)
    try:
        return serve_config_from_args(parser.parse_args(["serve"]))
    except ValueError as exc:
        raise ConfigError(f"{WHERE}: {exc}") from None


def max_ongoing_requests(config: ServeConfig) -> int:
    """Requests Serve lets into the replica at once: every admitted one (queued or running) plus a
    margin for the cheap endpoints, so that pdserve's own admission (503) decides, not Serve's queue."""
    running = config.num_decode * config.engine.max_num_seqs
    return config.router.max_queued_requests + running + HEALTH_REQUESTS


class _Router:
    """The Serve replica: starts the workers, serves ``create_app``'s app, stops the workers when deleted."""

    async def __init__(self, config: ServeConfig) -> None:  # type: ignore[misc]  # Serve awaits it
        self._service: Service | None = None
        context = serve.get_replica_context()
        if context.world_size > 1:
            raise ValueError(f"{DEPLOYMENT} runs one replica (it owns the workers); "
                             f"num_replicas is {context.world_size}")
        log.info("pdserve: configuration:\n%s", describe(config))
        prepared = await asyncio.to_thread(prepare_service, config)
        service = await asyncio.to_thread(launch_service, config, prepared)
        self._service = service
        try:
            await service.start(READY_TIMEOUT)
        except BaseException:
            await self._stop()
            raise
        log.info("pdserve: serving %s under Ray Serve (%d prefill, %d decode)",
                 prepared.router_config.model_name, config.num_prefill, config.num_decode)

    def __serve_build_asgi_app__(self) -> Any:
        assert self._service is not None
        return self._service.app

    async def _stop(self) -> None:
        service, self._service = self._service, None
        if service is None:
            return
        with contextlib.suppress(Exception):
            if service.planner is not None:
                await service.planner.stop()
            await service.client.close()
        await asyncio.to_thread(service.stop)
        service.prepared.tracing.shutdown()
        log.info("pdserve: workers stopped")

    async def __del__(self) -> None:
        await self._stop()


PdserveRouter: Deployment = serve.deployment(
    name=DEPLOYMENT, num_replicas=1, graceful_shutdown_timeout_s=30)(serve.ingress()(_Router))


def build_app(args: dict[str, Any] | None = None) -> Application:
    """The Serve application builder (``import_path: cli.serve_app:build_app``); see the module doc."""
    options = serve_options(args)
    deployment = PdserveRouter.options(max_ongoing_requests=max_ongoing_requests(options))
    return deployment.bind(options)

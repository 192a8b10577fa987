"""The cluster's admin endpoints, under the API key like every path but ``/health``.

``GET /v1/workers``: every live worker's ``WorkerStats`` (draining ones included) and, as
``draining``, the ids of the workers draining now.

``POST /v1/workers/{worker_id}/drain`` with an optional JSON body ``{"deadline_s": 60, "wait": true}``:
the worker leaves routing before the answer is sent (``router.drain``), finishes what it holds, frees
its KV and leases, and its actor is removed by the deadline (past it, what it still runs moves on as
after a worker death). ``wait`` true (the default) answers 200 with the ``DrainReport`` once it is
gone; false answers 202 ``{"worker_id", "state": "draining"}`` at once. 404: no such live worker;
409: it is draining already, or the last live worker of its role; 400 names a bad field.

``POST /v1/workers`` with a JSON body ``{"role": "prefill" | "decode", "wait": true}``: one more worker
of that role starts (its own placement group: on a Ray cluster with an autoscaler, a pending one is
what makes Ray add a node), loads, connects and joins routing (``cluster.fleet``). ``wait`` true (the
default) answers 200 ``{"worker_id", "role", "state": "serving"}`` once requests are routed to it, or
503 ``worker_start_failed`` (with Retry-After) naming why it could not start (it is removed again);
false answers 202 ``{"role", "state": "starting"}`` at once (``GET /v1/workers`` lists it once it
serves). 409: this server cannot start workers, or a colocated one is asked for a prefill worker.
With ``--planner`` on, the planner may later drain a worker it finds surplus.
"""

from __future__ import annotations

import asyncio
from typing import Annotated, Literal

import msgspec
from fastapi import FastAPI, Request
from msgspec import Meta
from starlette.responses import Response

from router.client import PDClient
from router.errors import AdminRefused, APIError, RequestFailed, unavailable
from router.http import read_body
from router.protocol import decode_body

WORKER_STATS_TIMEOUT = 5.0
MAX_DEADLINE_S = 3600.0
ADMIN_BODY_BYTES = 4096


class DrainRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    deadline_s: Annotated[float, Meta(gt=0, le=MAX_DEADLINE_S)] = 60.0
    wait: bool = True


class AddWorkerRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    role: Literal["prefill", "decode"]
    wait: bool = True


def add_admin_routes(app: FastAPI, client: PDClient) -> None:
    @app.get("/v1/workers")
    async def workers() -> Response:
        """Every live worker's current stats (KV blocks, running requests, leases, process id) and the
        ids of those draining."""
        if not client.is_ready():
            raise unavailable("The server is starting; retry shortly.", code="not_ready")
        try:
            stats = await asyncio.wait_for(client.stats(), WORKER_STATS_TIMEOUT)
        except (TimeoutError, RequestFailed) as exc:
            raise unavailable(f"Worker stats unavailable: {type(exc).__name__}", code="stats_unavailable") \
                from None
        body = {"workers": stats, "draining": client.draining()}
        return Response(msgspec.json.encode(body), media_type="application/json")

    @app.post("/v1/workers/{worker_id}/drain")
    async def drain(worker_id: str, request: Request) -> Response:
        """Drain a worker: out of routing now, its requests finished, its KV and leases freed, its
        actor removed (see the module docstring)."""
        raw = await read_body(request, ADMIN_BODY_BYTES)
        req = decode_body(raw, DrainRequest) if raw.strip() else DrainRequest()
        if not client.is_ready():
            raise unavailable("The server is starting; retry shortly.", code="not_ready")
        try:
            task = client.drain(worker_id, req.deadline_s)
        except AdminRefused as exc:
            raise APIError(exc.status, str(exc), param="worker_id", code=exc.code) from None
        if not req.wait:
            body = {"worker_id": worker_id, "state": "draining"}
            return Response(msgspec.json.encode(body), status_code=202, media_type="application/json")
        report = await asyncio.shield(task)  # a client that leaves does not stop the drain
        return Response(msgspec.json.encode(report), media_type="application/json")

    @app.post("/v1/workers")
    async def add_worker(request: Request) -> Response:
        """Start one more prefill or decode worker and let it join routing (see the module docstring)."""
        req = decode_body(await read_body(request, ADMIN_BODY_BYTES), AddWorkerRequest)
        if not client.is_ready():
            raise unavailable("The server is starting; retry shortly.", code="not_ready")
        try:
            task = client.add_worker(req.role)
        except AdminRefused as exc:
            raise APIError(exc.status, str(exc), param="role", code=exc.code) from None
        if not req.wait:
            body = {"role": req.role, "state": "starting"}
            return Response(msgspec.json.encode(body), status_code=202, media_type="application/json")
        try:
            worker_id = await asyncio.shield(task)  # a client that leaves does not stop the start
        except Exception as exc:  # the fleet removed it again; say why
            raise unavailable(f"The new {req.role} worker could not start: {type(exc).__name__}: {exc}",
                              code="worker_start_failed") from None
        body = {"worker_id": worker_id, "role": req.role, "state": "serving"}
        return Response(msgspec.json.encode(body), media_type="application/json")

"""The debug endpoint: ``GET /v1/prefix_index``, whether the router's prefix index agrees with each live
worker's cached blocks (a snapshot): ``{"agrees": bool, "workers": [{"worker_id", "indexed_blocks",
"cached_blocks", "missing", "extra", "agrees"}]}``. Under traffic they differ by the events not folded
in yet."""

from __future__ import annotations

import asyncio

import msgspec
from fastapi import FastAPI
from starlette.responses import Response

from router.admin import WORKER_STATS_TIMEOUT
from router.client import PDClient
from router.errors import RequestFailed, unavailable


def add_debug_routes(app: FastAPI, client: PDClient) -> None:
    @app.get("/v1/prefix_index")
    async def prefix_index() -> Response:
        """The router's prefix index against each live worker's cached blocks (see the module doc)."""
        if not client.is_ready():
            raise unavailable("The server is starting; retry shortly.", code="not_ready")
        try:
            rows = await asyncio.wait_for(client.prefix_index_agreement(), WORKER_STATS_TIMEOUT)
        except (TimeoutError, RequestFailed) as exc:
            raise unavailable(f"Worker snapshots unavailable: {type(exc).__name__}",
                              code="stats_unavailable") from None
        body = {"agrees": bool(rows) and all(r.agrees for r in rows), "workers": rows}
        return Response(msgspec.json.encode(body), media_type="application/json")

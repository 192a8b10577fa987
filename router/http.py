"""HTTP plumbing: the API-key and status-counting middleware, SSE responses, bounded body reads."""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator

import anyio
from fastapi import Request
from starlette.responses import StreamingResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from router.errors import too_large, unauthorized
from router.metrics import RouterMetrics

OPEN_PATHS = frozenset({"/health"})


class Gatekeeper:
    """ASGI middleware: the API key check on every path but /health, and request counting by status."""

    def __init__(self, app: ASGIApp, api_key: str | None, metrics: RouterMetrics) -> None:
        self.app, self.metrics = app, metrics
        self.expected = f"Bearer {api_key}".encode() if api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path: str = scope["path"]
        if self.expected is not None and path not in OPEN_PATHS:
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(given, self.expected):
                self.metrics.requests.labels(path, "401").inc()
                return await unauthorized().response()(scope, receive, send)
        status = ["499"]

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = str(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        finally:
            if path.startswith("/v1/"):
                self.metrics.requests.labels(path, status[0]).inc()


class SSEResponse(StreamingResponse):
    """A streaming response that always closes its body iterator (aborting unfinished requests)."""

    body_iterator: AsyncIterator[bytes]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()  # type: ignore[attr-defined]


async def read_body(request: Request, limit: int) -> bytes:
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise too_large(limit)
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > limit:
            raise too_large(limit)
    return bytes(body)

"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.

Every failure the router reports goes through :class:`APIError`, including the
ones FastAPI and Starlette raise themselves (unknown route, wrong method,
validation), so a client mistake is a 4xx with this body and never a 500.
"""

from __future__ import annotations

import logging

import msgspec
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from messages.wire import ErrorKind

log = logging.getLogger("pdserve.router")

INVALID_REQUEST = "invalid_request_error"
RETRY_AFTER_SECONDS = 1


class RequestFailed(RuntimeError):
    """A request could not be served by the workers; ``kind`` (an ``ErrorKind``) says why.

    It is a worker's ``WorkerError`` as the router raises it, or the router's own
    verdict (no live worker, a policy that forbids a fallback); ``api_error``
    turns it into the HTTP answer.
    """

    def __init__(self, kind: ErrorKind, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class ClientGone(Exception):
    """The HTTP client disconnected before the response was complete."""


class AdminRefused(Exception):
    """An admin change to the workers that cannot start; ``status`` and ``code`` are the HTTP answer's."""

    def __init__(self, status: int, message: str, code: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code


class DrainRefused(AdminRefused):
    """A worker drain that cannot start (``router.drain``)."""


class AddRefused(AdminRefused):
    """A worker that cannot be added (``PDClient.add_worker``)."""


class ErrorDetail(msgspec.Struct, frozen=True):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(msgspec.Struct, frozen=True):
    error: ErrorDetail


class APIError(Exception):
    """An HTTP error with an OpenAI-shaped body; ``headers`` are added to the response."""

    def __init__(self, status: int, message: str, type: str = INVALID_REQUEST, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.detail = ErrorDetail(message=message, type=type, param=param, code=code)
        self.headers = dict(headers or {})

    def body(self) -> ErrorBody:
        return ErrorBody(self.detail)

    def response(self) -> Response:
        return Response(msgspec.json.encode(self.body()), status_code=self.status,
                        media_type="application/json", headers=self.headers)


def invalid(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """400 invalid_request_error naming the offending parameter."""
    return APIError(400, message, param=param, code=code)


def unauthorized() -> APIError:
    return APIError(401, "Incorrect or missing API key; send it as 'Authorization: Bearer <key>'.",
                    code="invalid_api_key")


def model_not_found(model: str) -> APIError:
    return APIError(404, f"The model '{model}' does not exist.", param="model", code="model_not_found")


def too_large(limit: int) -> APIError:
    return APIError(413, f"Request body is larger than {limit} bytes.", code="request_too_large")


def timeout(seconds: float) -> APIError:
    return APIError(408, f"Request did not finish within {seconds:g} s.", type="timeout_error",
                    code="request_timeout")


def unavailable(message: str, code: str = "overloaded") -> APIError:
    """503 with Retry-After: the queue is full, no worker has room, or the cluster is not ready."""
    return APIError(503, message, type="service_unavailable_error", code=code,
                    headers={"Retry-After": str(RETRY_AFTER_SECONDS)})


def api_error(exc: BaseException, request_timeout: float) -> APIError:
    """The one map from what ended a generation request to its HTTP answer. A failed request by its
    kind: ``invalid`` is the client's (400), a worker-side deadline is 504, everything else is capacity
    (503 + Retry-After, the kind as ``code``). The request's own deadline is 408, a client gone 499, any
    other error 500; what is no error (a cancellation) is raised again."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, RequestFailed):
        if exc.kind is ErrorKind.INVALID:
            return invalid(str(exc))
        if exc.kind is ErrorKind.TIMEOUT:
            return APIError(504, str(exc), type="timeout_error", code="backend_timeout")
        return unavailable(str(exc), code=str(exc.kind))
    if isinstance(exc, TimeoutError):
        return timeout(request_timeout)
    if isinstance(exc, ClientGone):
        return APIError(499, "Client closed the request.", code="client_closed_request")
    if isinstance(exc, Exception):
        return APIError(500, f"Internal server error: {type(exc).__name__}", type="server_error",
                        code="internal_error")
    raise exc


def _status_code(status: int) -> str:
    return {404: "not_found", 405: "method_not_allowed"}.get(status, f"http_{status}")


def install_handlers(app: FastAPI) -> None:
    """Route APIError, HTTPException, RequestValidationError and anything unexpected to OpenAI bodies."""

    async def on_api_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, APIError)
        return exc.response()

    async def on_http(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        kind = INVALID_REQUEST if exc.status_code < 500 else "server_error"
        err = APIError(exc.status_code, str(exc.detail), type=kind, code=_status_code(exc.status_code),
                       headers=dict(exc.headers or {}))
        return err.response()

    async def on_validation(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(p) for p in first.get("loc", ()) if p not in ("body", "query", "path")]
        return invalid(str(first.get("msg", "invalid request")), ".".join(loc) or None).response()

    async def on_unexpected(_: Request, exc: Exception) -> Response:
        log.exception("unhandled error", exc_info=exc)
        return APIError(500, "Internal server error.", type="server_error", code="internal_error").response()

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(StarletteHTTPException, on_http)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(Exception, on_unexpected)

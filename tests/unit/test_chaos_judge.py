"""How the chaos soak classifies an error answer (``bench.chaos_load``): documented codes are clean
fault errors, as an HTTP status or as a stream's error event; anything else is a violation."""

from __future__ import annotations

import httpx
import pytest

from bench.chaos_load import Outcome, _error


def body(code: str) -> dict[str, object]:
    return {"error": {"message": "no live decode worker", "type": "service_unavailable_error", "code": code}}


@pytest.mark.parametrize(("status", "code", "headers", "kind"), [
    (503, "unavailable", {"Retry-After": "1"}, "fault_error"),
    (503, "unavailable", {}, "violation"),  # a 503 must say when to come back
    (200, "unavailable", None, "fault_error"),  # the stream's error event, after the 200 went out
    (200, "no_kv", None, "fault_error"),
    (200, "internal_error", None, "violation"),
    (500, "unavailable", {}, "violation"),
    (408, "request_timeout", {}, "fault_error"),
])
def test_error_classification(status: int, code: str, headers: dict[str, str] | None, kind: str) -> None:
    out = Outcome(spec=0, stream=status == 200, n=1, phase="load", start=0.0)
    _error(out, status, body(code), httpx.Headers(headers) if headers is not None else None)
    assert (out.kind, out.code, out.status) == (kind, code, status)


def test_an_error_without_an_openai_body_is_a_violation() -> None:
    out = Outcome(spec=0, stream=False, n=1, phase="load", start=0.0)
    _error(out, 503, {"detail": "nope"}, httpx.Headers({"Retry-After": "1"}))
    assert out.kind == "violation" and "without an OpenAI error body" in out.detail

"""Schema-driven fuzzing of the HTTP API (schemathesis): whatever the body, never a 500, always the
OpenAI error shape for a 4xx. Bounded: a few dozen cases per operation, short generations."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

if TYPE_CHECKING:
    from tests.integration.conftest import PdserveServer

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def fuzz_server(pdserve_factory: Callable[..., PdserveServer]) -> PdserveServer:
    return pdserve_factory("--served-model-name", "fuzz", "--max-model-len", "128", "--request-timeout", "3",
                           "--default-max-tokens", "2")


def check(case: Any, server: PdserveServer) -> None:
    if isinstance(case.body, dict) and "model" in case.body:
        case.body["model"] = "fuzz"  # reach the generation path, not just the 404
        case.body["max_tokens"] = 2
    response = case.call(base_url=server.url, timeout=30)
    assert response.status_code < 500, response.text
    if 400 <= response.status_code < 500:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}


def test_no_server_errors(fuzz_server: PdserveServer) -> None:
    schema = schemathesis.openapi.from_url(f"{fuzz_server.url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]  # type: ignore[union-attr]
    assert any(op.path == "/v1/chat/completions" for op in operations)
    for op in operations:
        @given(case=op.as_strategy())
        @settings(max_examples=25, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        def run(case: Any) -> None:
            check(case, fuzz_server)

        run()

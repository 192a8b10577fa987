"""``ClusterBackend.add_worker``: refusals before anything starts, and the task's result (no Ray: the
client's handles wrap fake actors; the cluster's ``launch`` hook is a plain coroutine here)."""

from __future__ import annotations

import asyncio

import pytest

from router.backend import ClusterBackend
from router.client import PDClient
from router.errors import AddRefused
from tests.fakes import FakeActor


def backend(colocated: bool) -> ClusterBackend:
    client = PDClient([] if colocated else [FakeActor()], [FakeActor()])
    return ClusterBackend(client, "m", colocated=colocated)


def test_add_worker_is_refused_without_a_launcher_and_for_prefill_when_colocated() -> None:
    async def run() -> None:
        with pytest.raises(AddRefused) as exc:
            backend(False).add_worker("decode")
        assert (exc.value.status, exc.value.code) == (409, "not_supported")
        colocated = backend(True)
        started: list[str] = []

        async def launch(role: str) -> str:
            started.append(role)
            return f"{role}-9"

        colocated.launch = launch
        with pytest.raises(AddRefused) as exc:
            colocated.add_worker("prefill")
        assert (exc.value.status, exc.value.code) == (409, "colocated") and started == []
        assert await colocated.add_worker("decode") == "decode-9" and started == ["decode"]

    asyncio.run(run())


def test_a_failed_start_reaches_the_caller() -> None:
    async def run() -> None:
        b = backend(False)

        async def launch(role: str) -> str:
            raise TimeoutError(f"{role} did not join")

        b.launch = launch
        with pytest.raises(TimeoutError, match="decode did not join"):
            await b.add_worker("decode")
        assert not b._joins  # forgotten once done

    asyncio.run(run())


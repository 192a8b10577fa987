"""The workers of the session's default `pdserve serve` run with torch's huge pages for large CPU tensors
(``cluster.workers.worker_env``): the switch is in each worker process's environment from its start, and
where the kernel offers transparent huge pages at all, the process holds some."""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest

if TYPE_CHECKING:
    from tests.integration.conftest import PdserveServer

pytestmark = pytest.mark.slow

THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode(errors="replace").split("=", 1) for item in raw if b"=" in item)


def test_workers_hold_huge_pages(pdserve_server: PdserveServer) -> None:
    rows = httpx.get(f"{pdserve_server.url}/v1/workers", timeout=30).json()["workers"]
    assert {w["role"] for w in rows} == {"prefill", "decode"}, rows
    offered = THP_MODE.is_file() and "[never]" not in THP_MODE.read_text()
    for w in rows:
        assert _environ(w["pid"]).get("THP_MEM_ALLOC_ENABLE") == "1", w["worker_id"]
        if offered:
            rollup = Path(f"/proc/{w['pid']}/smaps_rollup").read_text()
            found = re.search(r"AnonHugePages:\s+(\d+) kB", rollup)
            assert found is not None and int(found[1]) > 0, (w["worker_id"], rollup)

"""Disaggregated int4 KV: the two-codes-a-byte blocks and their (low, step) ranges cross NIXL byte for
byte, and decode continues exactly as colocated (``kernels/kv_int4.py``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import pytest

from cluster.workers import WorkerGroup
from tests.integration.test_disagg_fp8 import CONFIG as FP8_CONFIG
from tests.integration.test_disagg_fp8 import check_disaggregated_equals_colocated

CONFIG = replace(FP8_CONFIG, kv_cache_dtype="int4", kv_offload_bytes=0)


@pytest.fixture(scope="module")
def group(worker_group_factory: Callable[..., WorkerGroup]) -> WorkerGroup:
    return worker_group_factory(CONFIG, num_prefill=1, num_decode=1, transfer_timeout=20.0)


def test_disaggregated_int4_equals_colocated_int4(group: WorkerGroup) -> None:
    check_disaggregated_equals_colocated(group, CONFIG)

"""Disaggregated bfloat16 products (``--dtype bfloat16`` on CPU, ``kernels/cpu_bf16.c``): the K/V the
prefill worker's bfloat16 products computed cross NIXL byte for byte, and decode continues exactly as
colocated, since each product's value depends on its row alone (a token rounds alike in the prefill
worker's prompt chunk and in the decode worker's own)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import ray

from cluster.workers import WorkerGroup
from engine.config import EngineConfig
from messages.codec import unpack
from tests.integration.test_disagg_fp8 import check_disaggregated_equals_colocated
from transfer.wire import AgentInfo

CONFIG = EngineConfig(dtype="bfloat16", max_num_batched_tokens=512, kv_cache_memory=32 * 2**20)


@pytest.fixture(scope="module")
def group(worker_group_factory: Callable[..., WorkerGroup]) -> WorkerGroup:
    return worker_group_factory(CONFIG, num_prefill=1, num_decode=1, transfer_timeout=20.0)


def test_disaggregated_bf16_equals_colocated_bf16(group: WorkerGroup) -> None:
    info = unpack(ray.get(group.prefill[0].ready.remote(), timeout=60), AgentInfo)  # what prefill publishes
    assert info.layout.numerics == "bf16" and info.layout.dtype == "float32"  # bfloat16 products, float32 KV
    check_disaggregated_equals_colocated(group, CONFIG)

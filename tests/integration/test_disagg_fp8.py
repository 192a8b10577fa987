"""Disaggregated fp8 KV: blocks and their scales cross NIXL, and decode continues exactly as colocated;
the router's /metrics reports both workers' fp8 device and host tiers."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from cluster.workers import WorkerGroup
from engine.config import EngineConfig
from engine.loader import default_model_path, load_model_source
from engine.sampling_params import SamplingParams
from messages.codec import pack, unpack
from messages.wire import GenerateRequest, PrefillResult, TokenBatch, WorkerError
from router.client import PDClient
from router.handles import DecodeHandle

MODEL = str(default_model_path())
CONFIG = EngineConfig(dtype="float32", kv_cache_dtype="fp8", max_num_batched_tokens=512,
                      kv_cache_memory=32 * 2**20, kv_offload_bytes=4 * 2**20,
                      linear_kernel="plain")  # see SERVER_FLAGS
STORY = ("The lighthouse keeper counted the ships that passed each night and wrote their names in a "
         "leather book, noting the wind, the tide and the colour of every sail. ")


def run(coro: Any) -> Any:
    return asyncio.run(coro)


@pytest.fixture(scope="module")
def group(worker_group_factory: Callable[..., WorkerGroup]) -> WorkerGroup:
    return worker_group_factory(CONFIG, num_prefill=1, num_decode=1, transfer_timeout=20.0)


def req(tokens: list[int], max_tokens: int = 16) -> GenerateRequest:
    return GenerateRequest(request_id=uuid.uuid4().hex, prompt_token_ids=tokens,
                           sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))


async def collect(client: PDClient, r: GenerateRequest) -> list[int]:
    return [t async for b in client.generate(r) for t in b.token_ids]


def test_disaggregated_fp8_equals_colocated_fp8(group: WorkerGroup) -> None:
    check_disaggregated_equals_colocated(group, CONFIG)


def check_disaggregated_equals_colocated(group: WorkerGroup, config: EngineConfig) -> None:
    """Tokens through the handoff equal the decode worker's own, and the full blocks' codes and scales
    arrive byte for byte (``kv_digest``)."""
    tokenizer = load_model_source(MODEL).load_tokenizer()
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": c}])
               for c in ("What is the capital of France?", "Write a haiku about the sea.")]
    prompts.append(tokenizer.encode(STORY * 6 + "\nWhat did the keeper write down?"))
    colocated = PDClient([], group.decode)
    disagg = PDClient(group.prefill, group.decode)
    local = [run(collect(colocated, req(p))) for p in prompts]
    before = {s.worker_id: s for s in run(disagg.stats())}["decode-0"].transfer.blocks
    remote = [run(collect(disagg, req(p))) for p in prompts]
    stats = {s.worker_id: s for s in run(disagg.stats())}["decode-0"]
    assert stats.transfer.blocks > before  # the KV really crossed the wire
    assert remote == local and all(len(t) == 16 for t in local)

    # the codes and the per-block scales arrive byte for byte (the digest covers both); only the
    # full blocks are compared: decode's first token may grow the partial last block's scale
    prefill, decode = group.prefill[0], group.decode[0]
    tokens = tokenizer.encode(STORY * 4 + " A fresh prompt for the digest.")
    full = len(tokens) // config.block_size * config.block_size
    assert 0 < full < len(tokens)
    r = req(tokens, max_tokens=4)

    async def flow() -> tuple[str, str]:
        ref = prefill.prefill.remote(pack(r))
        result = await ref
        assert unpack(result, PrefillResult).request_id == r.request_id
        source_digest = await prefill.kv_digest.remote(r.request_id, full)
        outputs = DecodeHandle(decode).submit(r, ref, 1, 60, 60)  # the router's way in
        first = await outputs.next()
        assert isinstance(first, TokenBatch) and not first.finished
        sink_digest = await decode.kv_digest.remote(r.request_id, full)
        item: TokenBatch | WorkerError = first
        while isinstance(item, TokenBatch) and not item.finished:
            item = await outputs.next()
        outputs.close()
        assert isinstance(item, TokenBatch), item
        return source_digest, sink_digest

    source_digest, sink_digest = run(flow())
    assert source_digest == sink_digest


def test_metrics_report_fp8_device_and_host_tiers(group: WorkerGroup) -> None:
    """GET /metrics on the router app over these workers: capacities per tier, labelled fp8."""
    from prometheus_client.parser import text_string_to_metric_families

    from router.app import create_app
    from router.config import RouterConfig

    async def scrape() -> str:
        client = PDClient(group.prefill, group.decode)
        await client.start()
        app = create_app(client, load_model_source(MODEL).load_tokenizer(), RouterConfig("m", 2048))
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://r") as http:
                resp = await http.get("/metrics")
                assert resp.status_code == 200
                return resp.text
        finally:
            await client.close()

    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(run(scrape())) for s in f.samples}
    worker_tiers = {s.worker_id: {t.tier: t for t in s.kv.tiers}
                    for s in run(PDClient(group.prefill, group.decode).stats())}

    def get(name: str, worker: str, **labels: str) -> float:
        role = worker.split("-")[0]
        return samples[(f"pdserve:{name}", tuple(sorted({"worker": worker, "role": role, **labels}.items())))]

    block = 16 * 2 * 30 * 3 * 64 + 2 * 30 * 3 * 4  # SmolLM2 fp8 block: codes + float32 scales = 185,040
    for worker in ("prefill-0", "decode-0"):
        for tier, blocks in (("device", 181), ("host", 22)):  # 32 MiB // block, 4 MiB // block
            labels = {"tier": tier, "kv_cache_dtype": "fp8"}
            assert get("kv_cache_capacity_blocks", worker, **labels) == blocks
            assert get("kv_cache_capacity_tokens", worker, **labels) == blocks * 16
            assert get("kv_cache_capacity_bytes", worker, **labels) == blocks * block
            assert get("kv_cache_used_blocks", worker, **labels) == worker_tiers[worker][tier].used_blocks
        assert worker_tiers[worker]["device"].used_blocks == 0  # idle: no block held by a request or a lease
        # the device tier never filled (at most a few dozen of its 181 blocks were used), so nothing was
        # evicted to the host and nothing restored from it; test_kv_offload covers hits themselves
        host_hits = get("kv_offload_hits_total", worker, tier="host", kv_cache_dtype="fp8")
        assert host_hits == worker_tiers[worker]["host"].hits == 0
    tiers = {dict(k[1])["tier"] for k in samples if k[0] == "pdserve:kv_cache_capacity_blocks"}
    assert tiers == {"device", "host"}  # no disk tier configured: no disk series

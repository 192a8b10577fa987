"""Prefix-aware routing over KV events, conditional disaggregation, and decode-worker migration."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest
import ray

from cluster.workers import WorkerGroup
from engine.config import EngineConfig
from engine.loader import default_model_path, load_model_source
from engine.sampling_params import SamplingParams
from messages.wire import GenerateRequest, TokenBatch
from router.client import PDClient
from router.config import ClientConfig

MODEL = str(default_model_path())
CONFIG = EngineConfig(dtype="float32", max_num_batched_tokens=512, kv_cache_memory=128 * 2**20,
                      linear_kernel="plain")  # see SERVER_FLAGS
SYSTEM = ("You are the archivist of a harbour town. You answer questions about ships, tides, storms and "
          "the lighthouse, always citing the logbook page. ")


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return load_model_source(MODEL).load_tokenizer()


@pytest.fixture(scope="module")
def group(worker_group_factory: Callable[..., WorkerGroup]) -> WorkerGroup:
    return worker_group_factory(CONFIG, num_prefill=1, num_decode=2)


def req(tokens: list[int], max_tokens: int = 4, **kw: Any) -> GenerateRequest:
    return GenerateRequest(request_id=uuid.uuid4().hex, prompt_token_ids=tokens,
                           sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw))


async def collect(client: PDClient, r: GenerateRequest) -> list[TokenBatch]:
    return [b async for b in client.generate(r)]


async def settle_index(client: PDClient) -> None:
    """Refresh until the index equals every live worker's cached hashes."""
    assert client.table.index is not None
    deadline = time.monotonic() + 20
    while True:
        await client.table.refresh()
        live = [w for w in client.table.all() if w.alive]
        snaps = [await w.handle.kv_snapshot(30) for w in live]
        await client.table.refresh()
        if all(client.table.index.held(s.worker_id) == set(s.hashes) for s in snaps):
            return
        assert time.monotonic() < deadline, "prefix index never agreed with the workers"
        await asyncio.sleep(0.1)


def test_prefix_routing_follows_the_cached_prefix(group: WorkerGroup, tokenizer: Any) -> None:
    async def scenario() -> None:
        client = PDClient(group.prefill, group.decode, ClientConfig(routing="prefix"))
        await client.start()
        for k in range(3):
            prefix = tokenizer.encode(f"[{k}] " + SYSTEM * 12)[:192]
            assert len(prefix) == 192
            first = await collect(client, req(prefix + tokenizer.encode(" Which ship came first?")))
            await settle_index(client)
            holder = first[-1].worker_id
            for q in ("When was the storm?", "Who kept the lighthouse?"):
                later = await collect(client, req(prefix + tokenizer.encode(" " + q)))
                assert later[-1].worker_id == holder
                assert later[-1].cached_tokens >= 192
        assert client.routing_decisions()[("decode", "prefix", "prefix_hit")] >= 6
        await settle_index(client)
        await client.close()

    asyncio.run(scenario())


def test_requests_of_a_prefix_in_flight_follow_it_and_reuse_it(group: WorkerGroup, tokenizer: Any) -> None:
    """Two requests of a new 384-token prefix sent at once: the second follows the first (its prefix
    is pending there) instead of going to the idle decode worker, and the prefill worker computes
    the prefix once (the second waits for the first's blocks and reads them from the cache)."""

    async def scenario() -> None:
        client = PDClient(group.prefill, group.decode, ClientConfig(routing="prefix"))
        await client.start()
        prefix = tokenizer.encode("[in flight] " + SYSTEM * 24)[:384]
        questions = ("Which ship came first?", "Who kept the log?")
        pair = [req(prefix + tokenizer.encode(" " + q)) for q in questions]
        first, second = await asyncio.gather(*[collect(client, r) for r in pair])
        assert first[-1].worker_id == second[-1].worker_id
        assert sorted([first[0].cached_tokens, second[0].cached_tokens]) == [0, 384]
        assert client.routing_decisions()[("decode", "prefix", "prefix_hit")] >= 1
        await settle_index(client)
        assert not any(w.pending for w in client.table.all())  # replaced by the real KV events
        await client.close()

    asyncio.run(scenario())


def test_conditional_disaggregation_keeps_short_prompts_on_decode(
    group: WorkerGroup, tokenizer: Any
) -> None:
    async def scenario() -> None:
        config = ClientConfig(routing="round-robin", disagg_min_tokens=10_000)
        client = PDClient(group.prefill, group.decode, config)
        await client.start()
        before = sum(s.transfer.blocks for s in await client.stats())
        out = await collect(client, req(tokenizer.encode("The tide tables say"), max_tokens=6))
        assert sum(len(b.token_ids) for b in out) == 6
        assert sum(s.transfer.blocks for s in await client.stats()) == before
        assert client.routing_decisions()[("local", "round-robin", "short")] == 1
        await client.close()

    asyncio.run(scenario())


def test_decode_worker_killed_mid_stream_migrates(group: WorkerGroup, tokenizer: Any) -> None:
    prompt = tokenizer.encode(SYSTEM + " Tell the story of the red-sailed ship.")

    async def scenario() -> tuple[list[int], list[int], set[str]]:
        client = PDClient(group.prefill, group.decode, ClientConfig(migration_limit=1))
        await client.start()
        undisturbed = await collect(client, req(prompt, 48, ignore_eos=True))
        reference = [t for b in undisturbed for t in b.token_ids]
        got: list[int] = []
        servers: set[str] = set()
        killed = False
        async for batch in client.generate(req(prompt, 48, ignore_eos=True)):
            got.extend(batch.token_ids)
            servers.add(batch.worker_id)
            if not killed and len(got) >= 8:
                victim = next(w for w in client.table.decode if w.worker_id == batch.worker_id)
                ray.kill(victim.handle.actor, no_restart=True)
                killed = True
        survivors = [w for w in client.table.all() if w.alive]
        deadline = time.monotonic() + 20
        while True:
            stats = [await w.handle.stats(30) for w in survivors]
            if all(s.kv.used_blocks == 0 for s in stats):
                break
            assert time.monotonic() < deadline, stats
            await asyncio.sleep(0.1)
        await client.close()
        return reference, got, servers

    reference, got, servers = asyncio.run(scenario())
    assert got == reference
    assert len(servers) == 2

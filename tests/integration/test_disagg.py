"""Prefill and decode in separate Ray processes with KV moved over NIXL (UCX on CPU).

Every test ends with every worker's pool back to zero used blocks and its
integrity check passing.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from typing import Any

import msgspec
import pytest
import ray

from cluster.workers import WorkerGroup
from engine.config import EngineConfig
from engine.loader import default_model_path, load_model_source
from engine.sampling_params import SamplingParams
from messages.codec import pack, unpack
from messages.wire import GenerateRequest, PrefillResult, TokenBatch, WorkerError, WorkerStats
from router.client import PDClient
from router.config import ClientConfig, KvFailurePolicy
from router.errors import RequestFailed
from router.handles import DecodeHandle
from telemetry.tracing import TraceConfig
from tests.integration.otlp_receiver import OtlpReceiver
from tests.waiting import wait_until

MODEL = str(default_model_path())
CONFIG = EngineConfig(dtype="float32", max_num_batched_tokens=512, kv_cache_memory=256 * 2**20,
                      linear_kernel="plain")  # see SERVER_FLAGS
CHATS = ["What is the capital of France?", "Write a haiku about the sea.",
         "List three prime numbers greater than 100."]
RAW = ["def fibonacci(n):\n    ", "The three primary colors are"]
STORY = ("The lighthouse keeper counted the ships that passed each night and wrote their names in a "
         "leather book, noting the wind, the tide and the colour of every sail. ")


def run(coro: Any) -> Any:
    return asyncio.run(coro)


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return load_model_source(MODEL).load_tokenizer()


@pytest.fixture(scope="module")
def prompts(tokenizer: Any) -> list[list[int]]:
    out = [tokenizer.apply_chat_template([{"role": "user", "content": c}]) for c in CHATS]
    out += [tokenizer.encode(r) for r in RAW]
    out.append(tokenizer.encode(STORY * 30 + "\nWhat did the keeper write down?"))
    return out


@pytest.fixture(scope="module")
def group(worker_group_factory: Callable[..., WorkerGroup]) -> WorkerGroup:
    return worker_group_factory(CONFIG, num_prefill=2, num_decode=1, transfer_timeout=20.0, share_cores=True)


def req(tokens: list[int], max_tokens: int = 24, **kw: Any) -> GenerateRequest:
    return GenerateRequest(request_id=uuid.uuid4().hex, prompt_token_ids=tokens,
                           sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw))


async def collect(client: PDClient, r: GenerateRequest) -> list[int]:
    return [t async for b in client.generate(r) for t in b.token_ids]


def settle(client: PDClient, timeout: float = 20.0) -> None:
    """Wait until no worker holds a used block, then check every pool's invariants."""
    seen: list[WorkerStats] = []

    def free() -> bool:
        seen[:] = run(client.stats())
        return all(s.kv.used_blocks == 0 and s.leases.held == 0 for s in seen)

    wait_until(free, timeout, "no block held", 0.1, lambda: seen)
    run(client.check_integrity())


def test_disaggregated_equals_colocated(group: WorkerGroup, prompts: list[list[int]]) -> None:
    colocated = PDClient([], group.decode)
    disagg = PDClient(group.prefill[:1], group.decode)

    async def both() -> tuple[list[list[int]], list[list[int]]]:
        a = await asyncio.gather(*[collect(colocated, req(p)) for p in prompts])
        b = await asyncio.gather(*[collect(disagg, req(p)) for p in prompts])
        return a, b

    local, remote = run(both())
    assert local == remote
    assert all(len(t) > 0 for t in local)
    stats = {s.worker_id: s for s in run(disagg.stats())}
    assert stats["decode-0"].transfer.blocks > 0
    # the idle prefill workers lent their threads to decode steps (worker/core_share.py): same tokens
    assert stats["decode-0"].cores.borrowed_steps > 0
    settle(disagg)


def test_kv_bytes_equal_on_both_sides(group: WorkerGroup, tokenizer: Any) -> None:
    prefill, decode = group.prefill[0], group.decode[0]
    tokens = tokenizer.encode(STORY * 12 + " Fresh prompt for the digest check.")
    r = req(tokens, max_tokens=40, ignore_eos=True)

    async def flow() -> tuple[str, str]:
        ref = prefill.prefill.remote(pack(r))
        result = await ref
        assert unpack(result, PrefillResult).request_id == r.request_id
        source_digest = await prefill.kv_digest.remote(r.request_id, len(tokens))
        outputs = DecodeHandle(decode).submit(r, ref, 1, 60, 60)  # the router's way in
        first = await outputs.next()
        assert isinstance(first, TokenBatch) and not first.finished
        sink_digest = await decode.kv_digest.remote(r.request_id, len(tokens))
        item: TokenBatch | WorkerError = first
        while isinstance(item, TokenBatch) and not item.finished:
            item = await outputs.next()
        outputs.close()
        assert isinstance(item, TokenBatch), item
        return source_digest, sink_digest

    source_digest, sink_digest = run(flow())
    assert source_digest == sink_digest
    settle(PDClient(group.prefill, group.decode))


def test_only_missing_blocks_cross_the_wire(group: WorkerGroup, tokenizer: Any) -> None:
    client = PDClient(group.prefill[:1], group.decode)
    prefix = tokenizer.encode(STORY * 20)[:256]
    first = prefix + tokenizer.encode(" Question: how many ships?")
    second = prefix + tokenizer.encode(" Question: which colour were the sails that night?")
    run(collect(client, req(first, max_tokens=4)))
    before = {s.worker_id: s for s in run(client.stats())}["decode-0"]
    run(collect(client, req(second, max_tokens=4)))
    after = {s.worker_id: s for s in run(client.stats())}["decode-0"]
    block = CONFIG.block_size
    expected_blocks = -(-len(second) // block) - 256 // block
    assert after.transfer.blocks - before.transfer.blocks == expected_blocks
    region = 2 * block * 3 * 64 * 4
    assert after.transfer.bytes - before.transfer.bytes == expected_blocks * 30 * region
    settle(client)


def test_lease_expires_when_decode_never_pulls(group: WorkerGroup, prompts: list[list[int]]) -> None:
    prefill = group.prefill[1]
    r = req(prompts[5])
    before = unpack(ray.get(prefill.stats.remote(), timeout=30), WorkerStats)
    ray.get(prefill.prefill.remote(pack(r), lease_seconds=0.5), timeout=60)
    held = unpack(ray.get(prefill.stats.remote(), timeout=30), WorkerStats)
    assert held.kv.used_blocks > 0 and held.leases.held == 1
    settle(PDClient(group.prefill, group.decode))
    after = unpack(ray.get(prefill.stats.remote(), timeout=30), WorkerStats)
    assert after.leases.expired == before.leases.expired + 1


@pytest.mark.parametrize("policy", list(KvFailurePolicy))
def test_injected_transfer_failure(
    group: WorkerGroup, prompts: list[list[int]], policy: KvFailurePolicy
) -> None:
    client = PDClient(group.prefill, group.decode, ClientConfig(kv_failure_policy=policy))
    reference = run(collect(PDClient([], group.decode), req(prompts[0])))
    failures_before = {s.worker_id: s for s in run(client.stats())}["decode-0"].transfer.failures
    ray.get(group.decode[0].inject_transfer_failures.remote(1), timeout=30)
    if policy is KvFailurePolicy.FAIL:
        with pytest.raises(RequestFailed) as info:
            run(collect(client, req(prompts[0])))
        assert info.value.kind == "transfer"
    else:
        assert run(collect(client, req(prompts[0]))) == reference
    stats = {s.worker_id: s for s in run(client.stats())}
    assert stats["decode-0"].transfer.failures == failures_before + 1
    settle(client)


def test_retried_transfer_leaves_two_transfer_spans(group: WorkerGroup, prompts: list[list[int]]) -> None:
    """A pull that fails once and is retried on the other prefill worker shows up as two ``kv.transfer``
    spans (attempts 1 and 2, outcomes ``injected`` and ``ok``) under one ``decode.queue``, exported over
    OTLP/HTTP from the worker processes."""
    receiver = OtlpReceiver()
    config = pack(TraceConfig(endpoint=receiver.url))
    try:
        ray.get([w.set_tracing.remote(config) for w in group.all()], timeout=30)
        client = PDClient(group.prefill, group.decode, ClientConfig(kv_failure_policy=KvFailurePolicy.RETRY))
        ray.get(group.decode[0].inject_transfer_failures.remote(1), timeout=30)
        trace_id, parent = uuid.uuid4().hex, uuid.uuid4().hex[:16]
        r = msgspec.structs.replace(req(prompts[0], max_tokens=4),
                                    trace_context={"traceparent": f"00-{trace_id}-{parent}-01"})
        assert len(run(collect(client, r))) == 4
        receiver.wait(lambda: {s.name for s in receiver.trace(trace_id)} >= {"decode", "prefill.compute"})
        spans = receiver.trace(trace_id)
        kv = sorted((s for s in spans if s.name == "kv.transfer"), key=lambda s: s.attrs["kv.attempt"])
        assert [(s.attrs["kv.attempt"], s.attrs["kv.outcome"]) for s in kv] == [(1, "injected"), (2, "ok")]
        assert kv[0].status == 2 and kv[1].status != 2  # STATUS_CODE_ERROR, then not an error
        assert kv[0].attrs["kv.source_agent"] != kv[1].attrs["kv.source_agent"]
        (queue,) = [s for s in spans if s.name == "decode.queue"]
        assert {s.parent_id for s in kv} == {queue.span_id} and queue.parent_id == parent
        assert len([s for s in spans if s.name == "prefill.compute"]) == 2
        settle(client)
    finally:
        ray.get([w.set_tracing.remote(None) for w in group.all()], timeout=30)
        receiver.close()


def test_abort_mid_decode_frees_both_sides(group: WorkerGroup, prompts: list[list[int]]) -> None:
    client = PDClient(group.prefill, group.decode)

    async def partial() -> int:
        got = 0
        stream = client.generate(req(prompts[5], max_tokens=400, ignore_eos=True))
        async for batch in stream:
            got += len(batch.token_ids)
            if got >= 3:
                break
        await stream.aclose()
        return got

    assert run(partial()) >= 3
    settle(client)


def test_killed_prefill_worker_request_completes_on_the_other(
    group: WorkerGroup, tokenizer: Any
) -> None:
    """The prefill worker computing a request is killed while it provably holds it (its stats show the
    request running); the request completes with the colocated greedy tokens, the other prefill worker
    computed the whole prompt (its prefix-cache queries grew by exactly the prompt, with no hit), and no
    block stays held. The victim is whichever worker the routing picked."""
    # no other test's prompt starts like this one, so no block of it is cached anywhere: every chunk (3 of
    # 512 tokens) is a step of its own, and stats (read between steps) see it running
    prompt = tokenizer.encode("Only the kill test sends this prompt. " + STORY * 30)
    client = PDClient(group.prefill, group.decode, ClientConfig(routing="round-robin", prefill_timeout=60))

    def stats(worker: Any) -> WorkerStats:
        return unpack(ray.get(worker.stats.remote(), timeout=30), WorkerStats)

    before = [stats(w) for w in group.prefill]
    assert all(s.requests.running == 0 and s.requests.waiting == 0 for s in before)

    async def kill_while_running() -> tuple[list[int], int]:
        task = asyncio.create_task(collect(client, req(prompt, max_tokens=8)))
        deadline = time.monotonic() + 60
        while True:
            now = await asyncio.gather(*[w.stats.remote() for w in group.prefill])
            running = [i for i, b in enumerate(now) if unpack(b, WorkerStats).requests.running]
            if running:
                break
            assert not task.done() and time.monotonic() < deadline, "no prefill worker ran the request"
            await asyncio.sleep(0.01)
        (victim,) = running
        ray.kill(group.prefill[victim], no_restart=True)
        return await task, victim

    tokens, victim = run(kill_while_running())
    survivor = 1 - victim
    after = stats(group.prefill[survivor])
    queried = after.kv.prefix_queries - before[survivor].kv.prefix_queries
    assert queried == len(prompt), "the survivor did not retry"
    assert after.kv.prefix_hits == before[survivor].kv.prefix_hits  # it computed every token itself
    assert tokens == run(collect(PDClient([], group.decode), req(prompt, max_tokens=8)))
    settle(PDClient([group.prefill[survivor]], group.decode))


def test_one_output_channel_carries_every_request_of_a_step(group: WorkerGroup,
                                                            prompts: list[list[int]]) -> None:
    """Concurrent requests on one decode worker come back on its one output channel, a step's items in
    one frame (``decode/outbox.py``, ``router/channel.py``): each request gets its own greedy tokens (a
    prompt sent twice at once gets the same tokens twice, the same as in an earlier run of the batch), in
    far fewer Ray items than token batches."""
    decode = group.decode[0]
    requests = [req(p, max_tokens=16, ignore_eos=True) for p in prompts[:5]] * 2

    def fresh(r: GenerateRequest) -> GenerateRequest:
        return msgspec.structs.replace(r, request_id=uuid.uuid4().hex)

    async def together() -> list[list[int]]:
        return list(await asyncio.gather(*[collect(client, fresh(r)) for r in requests]))

    client = PDClient([], group.decode)
    handle = client.table.decode[0].handle
    assert isinstance(handle, DecodeHandle)
    earlier = run(together())
    before = unpack(ray.get(decode.stats.remote(), timeout=30), WorkerStats)
    received = handle.channel.frames, handle.channel.items
    shared = run(together())
    after = unpack(ray.get(decode.stats.remote(), timeout=30), WorkerStats)
    assert shared == earlier and shared[:5] == shared[5:] and all(len(t) == 16 for t in shared)
    frames, items = handle.channel.frames - received[0], handle.channel.items - received[1]  # the router's
    assert (frames, items) == (after.outputs.frames - before.outputs.frames,
                               after.outputs.items - before.outputs.items)  # what the worker sent
    assert items >= 10 * 16 // 2  # a batch per request per step, give or take a merged pair
    assert frames * 4 <= items, (frames, items)  # ten requests a step: most frames carry several
    settle(client)


def test_a_closed_channel_fails_its_attempts_and_loses_nothing(group: WorkerGroup,
                                                               prompts: list[list[int]]) -> None:
    """Closing a decode worker's channel while a request streams on it ends that request with an error
    at once (no hang until the item timeout), the request is aborted on the worker (every block back),
    and the next request opens a new channel and is served."""
    client = PDClient([], group.decode)
    handle = client.table.decode[0].handle
    assert isinstance(handle, DecodeHandle)

    async def flow() -> tuple[str, list[int]]:
        stream = client.generate(req(prompts[5], max_tokens=400, ignore_eos=True))
        await anext(stream)
        first_name = handle.channel.name
        handle.close()
        outputs = handle.channel.open(60)  # the next channel, before the closed one's reader has ended
        with pytest.raises(RuntimeError, match="closed"):
            async with asyncio.timeout(10):
                async for _ in stream:
                    pass
        with pytest.raises(TimeoutError):  # the closed channel's end failed its own attempts only
            async with asyncio.timeout(0.5):
                await outputs.next()
        outputs.close()
        return first_name, await collect(client, req(prompts[0], max_tokens=4))

    first_name, tokens = run(flow())
    assert len(tokens) == 4 and handle.channel.name != first_name
    settle(client)

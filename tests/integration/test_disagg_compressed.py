"""A compressed sequence across the disaggregated handoff: a prompt the prefill worker computed in chunks
under ``--kv-window`` (sinks + window) or ``--kv-eviction h2o`` arrives on the decode worker as it is, its
kept blocks only, the tokens it dropped and (H2O) its blocks' attention mass per layer and KV head, and
decodes exactly as the same prompt colocated on the decode worker; both workers hold no block afterwards.
The two sides must agree on the scheme (``KvLayout.kv_compression``)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import msgspec
import pytest

from cluster.workers import WorkerGroup
from engine.config import EngineConfig
from engine.loader import load_model_source
from messages.codec import pack, unpack
from messages.wire import PrefillResult, TokenBatch, WorkerError
from router.client import PDClient
from router.handles import DecodeHandle
from tests.integration.test_disagg_fp8 import MODEL, STORY, collect, req, run
from transfer.compat import check_compatible, compat_hash
from transfer.errors import IncompatibleKvError
from transfer.wire import WIRE_VERSION, AgentInfo, KvLayout

BASE = dict(dtype="float32", max_num_batched_tokens=64, kv_cache_memory=32 * 2**20, linear_kernel="plain")
CONFIGS = {
    "window": EngineConfig(**BASE, kv_window=64, kv_sinks=16),  # type: ignore[arg-type]
    "h2o": EngineConfig(**BASE, kv_eviction="h2o", kv_budget=96),  # type: ignore[arg-type]
}
# head-wise crosses as H2O does (its engine's half: tests/unit/test_kv_eviction.py); its scheme differs
HEADWISE = EngineConfig(**BASE, kv_eviction="headwise", kv_budget=96)  # type: ignore[arg-type]


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def scheme(request: pytest.FixtureRequest,
           worker_group_factory: Callable[..., WorkerGroup]) -> tuple[str, WorkerGroup]:
    group = worker_group_factory(CONFIGS[request.param], num_prefill=1, num_decode=1, transfer_timeout=20.0)
    return request.param, group


async def _disaggregated(group: WorkerGroup, tokens: list[int],
                         max_tokens: int) -> tuple[PrefillResult, list[int]]:
    """The prefill worker's result (its handle) and the tokens the decode worker made from it."""
    r = req(tokens, max_tokens)
    ref = group.prefill[0].prefill.remote(pack(r))
    result = unpack(await ref, PrefillResult)
    outputs = DecodeHandle(group.decode[0]).submit(r, ref, 1, 60, 60)  # the router's way in
    out: list[int] = []
    item: TokenBatch | WorkerError | None = None
    while not (isinstance(item, TokenBatch) and item.finished):
        item = await outputs.next()
        assert isinstance(item, TokenBatch), item
        out += item.token_ids
    outputs.close()
    return result, out


def _used_blocks(group: WorkerGroup) -> dict[str, int]:
    return {s.worker_id: s.kv.used_blocks for s in run(PDClient(group.prefill, group.decode).stats())}


def test_compressed_sequence_decodes_as_colocated(scheme: tuple[str, WorkerGroup]) -> None:
    name, group = scheme
    source = load_model_source(MODEL)
    tokenizer = source.load_tokenizer()
    width = source.config.num_layers * source.config.num_kv_heads  # a block's masses: per layer and KV head
    bs = 16
    for i, text in enumerate((STORY * 6 + "\nWhat did the keeper write down?", STORY * 9 + " And then?")):
        prompt = tokenizer.encode(f"{i}: {text}")
        # disaggregated first: the decode worker's blocks then carry no mass of this prompt's own
        before = {s.worker_id: s for s in run(PDClient(group.prefill, group.decode).stats())}["decode-0"]
        result, remote = run(_disaggregated(group, prompt, 24))
        handle = result.handle
        kept = handle.num_tokens - handle.dropped_tokens
        assert handle.num_tokens == len(prompt) and handle.dropped_tokens > 0, handle
        assert handle.dropped_tokens % bs == 0 and len(handle.block_ids) == math.ceil(kept / bs)
        after = {s.worker_id: s for s in run(PDClient(group.prefill, group.decode).stats())}["decode-0"]
        assert after.transfer.blocks - before.transfer.blocks == len(handle.block_ids)  # only the kept ones
        # H2O's blocks arrive with the masses (per layer and KV head) that choose its next victims; a
        # window needs none
        assert len(handle.block_mass) == (0 if name == "window" else len(handle.block_ids) * width)
        assert name == "window" or sum(handle.block_mass[:width]) > 0
        assert all(m >= 0 for m in handle.block_mass)
        local = run(collect(PDClient([], group.decode), req(prompt, 24)))
        assert remote == local and len(local) == 24, (remote, local)

    deadline = time.monotonic() + 10  # a lease ends on the decode side's "done": the prefill side frees next
    while any(_used_blocks(group).values()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _used_blocks(group) == {"prefill-0": 0, "decode-0": 0}
    # /metrics' kv_kept_fraction: each of the decode worker's four finished requests, every one compressed
    kv = {s.worker_id: s for s in run(PDClient(group.prefill, group.decode).stats())}["decode-0"].kv
    assert kv.head_budget is None  # head-wise only
    if name == "window":
        assert kv.kept_fraction is None
    else:
        assert kv.kept_fraction is not None and sum(kv.kept_fraction.counts) == 4
        assert 0 < kv.kept_fraction.sum < 4


def test_the_compression_scheme_is_part_of_transfer_compatibility() -> None:
    layout = KvLayout("m", "float32", 2, 8, 16, 2, 16, 4, kv_compression=CONFIGS["window"].kv_compression)
    others = ("", CONFIGS["h2o"].kv_compression, HEADWISE.kv_compression, "window=128,sinks=16")
    for other in others:
        theirs = msgspec.structs.replace(layout, kv_compression=other)
        assert compat_hash(theirs) != compat_hash(layout)
        info = AgentInfo(WIRE_VERSION, compat_hash(theirs), "peer", b"", 0, 0, "DRAM", theirs)
        with pytest.raises(IncompatibleKvError, match="kv_compression"):
            check_compatible(layout, info)
    assert CONFIGS["window"].kv_compression == "window=64,sinks=16"
    assert CONFIGS["h2o"].kv_compression == "h2o,budget=96,recent=48"
    assert HEADWISE.kv_compression == "headwise,budget=96,recent=48"
    assert EngineConfig().kv_compression == ""

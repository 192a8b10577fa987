"""Disaggregation across tensor-parallel sizes, at the engine + transfer level: prefill engines of TP 1 and
2 lend their KV over real NIXL (one agent per rank, rank processes from ``engine/tp_ranks.py``), decode
engines of TP 1 and 2 pull it, every decode rank reading only its KV heads from the prefill ranks holding
them. Greedy tokens equal colocated TP=1; each decode rank's KV bytes equal the prefill side's heads.
A latent cache (DeepSeek-V3) is whole on every rank: each decode rank reads all of it."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.llm import start_engine
from engine.tp_ranks import RankProcesses
from tests import families
from tests.integration.test_tensor_parallel import NEW_TOKENS, prompts, save
from tests.waiting import wait_until
from transfer.descriptors import merged_descriptor_count
from transfer.errors import IncompatibleKvError
from transfer.nixl_sink import KvSink
from transfer.nixl_source import KvSource
from transfer.wire import AgentInfo, KvHandle
from worker.tp_kv import EXTENSION, GroupSink, group_block_bytes, open_sink, open_source

pytestmark = pytest.mark.slow

ENGINE: dict[str, Any] = dict(dtype="float32", max_num_batched_tokens=32, num_threads=1,
                              kv_cache_memory=1024**2, tp_timeout_s=20.0, block_size=8,
                              enable_prefix_caching=False)
WAIT_S = 20.0


class Side:
    def __init__(self, path: Path, size: int, role: str) -> None:
        self.size = size
        config = EngineConfig(tensor_parallel_size=size, **ENGINE)
        self.engine: LLMEngine
        self.ranks: RankProcesses | None
        self.engine, self.ranks = start_engine(str(path), config, extension=EXTENSION)
        name = f"{role}{size}-{uuid.uuid4().hex[:6]}"
        self.source: KvSource | None = None
        self.sink: KvSink | GroupSink | None = None
        self.info: AgentInfo | None = None
        if role == "prefill":
            self.source, self.info = open_source(self.engine, name)
        else:
            self.sink = open_sink(self.engine, name)

    def close(self) -> None:
        for agent in (self.source, self.sink):
            if agent is not None:
                agent.close()
        if self.ranks is not None:
            self.ranks.close()


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("llama")
    save("llama", path)  # 8 query / 2 KV heads: one KV head per rank at TP=2
    return path


@pytest.fixture(scope="module")
def reference(model: Path) -> list[list[int]]:
    llm = LLM(model=str(model), **ENGINE)
    greedy = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)
    return [o.token_ids for o in llm.generate(prompts(), greedy)]


@pytest.fixture(scope="module")
def sides(model: Path) -> Iterator[dict[tuple[str, int], Side]]:
    made: dict[tuple[str, int], Side] = {}
    try:
        for role in ("prefill", "decode"):
            for size in (1, 2):
                made[role, size] = Side(model, size, role)
        yield made
    finally:
        for side in made.values():
            side.close()


def heads_of(data: bytes, engine: LLMEngine, blocks: int, heads: int) -> torch.Tensor:
    """One rank's ``block_bytes`` as ``[layers, blocks, 2, block_size, heads, head_dim]`` float32."""
    c = engine.model_config
    return torch.frombuffer(bytearray(data), dtype=torch.float32).view(
        c.num_layers, blocks, 2, engine.config.block_size, heads, c.head_dim)


def descriptors_of(prefill: Side, decode: Side, remote: list[int], local: list[int]) -> int:
    """The descriptors a read of ``remote`` into ``local`` takes, all decode ranks: equal head ranges read
    whole regions into whole regions (one descriptor per (layer, run of blocks consecutive on both
    sides)); different ones stage each needed source rank's whole regions (one per (layer, run of
    consecutive source blocks)); every decode rank here needs max(p, d) // d source ranks."""
    layers = prefill.engine.model_config.num_layers
    r, lo = np.asarray(remote), np.asarray(local)
    if prefill.size == decode.size:
        idx = np.arange(layers)[:, None]
        local_idx = (idx * decode.engine.runner.kv_cache.shape[1] + lo).ravel()
        remote_idx = (idx * prefill.engine.runner.kv_cache.shape[1] + r).ravel()
        return prefill.size * merged_descriptor_count(local_idx, remote_idx)
    runs = 1 + int(np.count_nonzero(np.diff(r) != 1))
    return max(prefill.size, decode.size) * layers * runs


def run_one(prefill: Side, decode: Side, ids: list[int]) -> tuple[list[int], int, int]:
    """Prefill ``ids``, move its KV, check each decode rank's bytes, decode: (tokens, descriptors, the
    descriptors expected)."""
    pe, de = prefill.engine, decode.engine
    rid, first, blocks, local, stats = _hand_over(prefill, decode, ids)
    head_dim, n = pe.model_config.head_dim, len(blocks)
    kv_heads = pe.model_config.num_kv_heads
    kv_bytes = pe.model_config.num_layers * n * 2 * pe.config.block_size * kv_heads * head_dim * 4
    assert stats.bytes == kv_bytes
    # staging reads each needed source rank's whole regions: 2:1 no extra bytes, 1:2 each decode rank
    # reads both heads to keep one
    staged = 0 if prefill.size == decode.size else kv_bytes * max(1, decode.size // prefill.size)
    assert stats.staged_bytes == staged

    # every decode rank's bytes are exactly the prefill ranks' bytes of its heads
    per_p = kv_heads // prefill.size
    full = torch.cat([heads_of(b, pe, n, per_p) for b in group_block_bytes(pe, blocks)], dim=4)
    per_d = kv_heads // decode.size
    for rank, data in enumerate(group_block_bytes(de, local)):
        want = full[:, :, :, :, rank * per_d:(rank + 1) * per_d].contiguous().numpy().tobytes()
        assert data == want, f"decode rank {rank} of {decode.size} differs from prefill TP={prefill.size}"
    return _decode(prefill, decode, rid, first, n), stats.descriptors, descriptors_of(prefill, decode, blocks,
                                                                                      local)


def _hand_over(prefill: Side, decode: Side, ids: list[int]) -> tuple[str, int, list[int], list[int], Any]:
    """Prefill ``ids`` holding its KV, reserve it on decode and read it: (request id, first token, prefill
    blocks, decode blocks, the read's stats)."""
    assert prefill.source is not None and prefill.info is not None and decode.sink is not None
    pe, de, rid = prefill.engine, decode.engine, f"r-{uuid.uuid4().hex[:8]}"
    pe.add_request(ids, SamplingParams(max_tokens=1, temperature=0.0), request_id=rid, hold_kv=True)
    first = None
    while pe.has_unfinished():
        for out in pe.step():
            if out.finished:
                first = out.token_ids[0]
    assert first is not None
    blocks = pe.kv.blocks_of(rid)
    deadline = time.time() + WAIT_S
    prefill.source.add_lease(rid, deadline)
    handle = KvHandle(rid, prefill.info.agent_name, blocks, len(ids), prefill.info.compat_hash, deadline)
    request = de.make_request(ids, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0), request_id=rid)
    assert de.reserve(request) is not None
    local = de.kv.blocks_of(rid)[: len(blocks)]
    return rid, first, blocks, local, decode.sink.read_blocking(handle, blocks, local, WAIT_S)


def _decode(prefill: Side, decode: Side, rid: str, first: int, n: int) -> list[int]:
    """After the read: the lease ends, prefill frees the blocks, decode runs to the end and frees its own."""
    pe, de = prefill.engine, decode.engine
    released: list[str] = []
    source = prefill.source
    assert source is not None

    def lease_ended() -> bool:
        released.extend(source.poll()[0])
        return rid in released

    wait_until(lease_ended, WAIT_S, f"the done notification of {rid}", 0.01)
    assert pe.release_kv(rid) == n and pe.kv.pool.num_used_blocks == 0

    out = de.start_prefilled(rid, first)
    while de.has_unfinished():
        for o in de.step():
            if o.finished:
                out = o
    assert de.kv.pool.num_used_blocks == 0
    return out.token_ids


@pytest.mark.parametrize(("p", "d"), [(2, 1), (1, 2), (2, 2), (1, 1)])
def test_tokens_and_kv_bytes_across_tp_sizes(sides: dict[tuple[str, int], Side], reference: list[list[int]],
                                             p: int, d: int) -> None:
    prefill, decode = sides["prefill", p], sides["decode", d]
    assert decode.sink is not None and prefill.info is not None
    decode.sink.connect(prefill.info)
    got, descriptors, expected = zip(*(run_one(prefill, decode, ids) for ids in prompts()), strict=True)
    assert list(got) == reference
    assert descriptors == expected


def test_a_source_group_without_its_other_ranks_is_refused_at_handshake(
        sides: dict[tuple[str, int], Side]) -> None:
    decode, prefill = sides["decode", 1], sides["prefill", 2]
    assert decode.sink is not None and prefill.info is not None
    partial = msgspec.structs.replace(prefill.info, agent_name="partial", tp_ranks=[])
    with pytest.raises(IncompatibleKvError, match="incomplete") as err:
        decode.sink.connect(partial)
    assert err.value.field == "tp_size"


@pytest.fixture(scope="module")
def latent_sides(tmp_path_factory: pytest.TempPathFactory
                 ) -> Iterator[tuple[list[list[int]], dict[Any, Side]]]:
    """DeepSeek-V3 (4 query heads, one latent) at TP 1 and 2 on each side, and the colocated TP 1 tokens."""
    path = tmp_path_factory.mktemp("deepseek")
    families.save("deepseek_v3", path)
    llm = LLM(model=str(path), **ENGINE)
    reference = [o.token_ids for o in llm.generate(prompts(), SamplingParams(max_tokens=NEW_TOKENS,
                                                                             temperature=0.0))]
    made: dict[tuple[str, int], Side] = {}
    try:
        for role, size in (("prefill", 1), ("prefill", 2), ("decode", 1), ("decode", 2)):
            made[role, size] = Side(path, size, role)
        yield reference, made
    finally:
        for side in made.values():
            side.close()


@pytest.mark.parametrize(("p", "d"), [(2, 1), (1, 2)])
def test_the_latent_crosses_tp_sizes_whole_to_every_rank(
        latent_sides: tuple[list[list[int]], dict[Any, Side]], p: int, d: int) -> None:
    """Every rank caches the same latent: each decode rank of either size reads it whole, bytes equal to
    every prefill rank's, and the tokens equal colocated TP 1."""
    reference, sides = latent_sides
    prefill, decode = sides["prefill", p], sides["decode", d]
    assert decode.sink is not None and prefill.info is not None
    decode.sink.connect(prefill.info)
    got = []
    for ids in prompts():
        rid, first, blocks, local, stats = _hand_over(prefill, decode, ids)
        c = prefill.engine.model_config
        latent_bytes = c.num_layers * len(blocks) * prefill.engine.config.block_size * c.kv_head_dim * 4
        sent = group_block_bytes(prefill.engine, blocks)
        assert len(sent[0]) == latent_bytes and all(b == sent[0] for b in sent)
        assert group_block_bytes(decode.engine, local) == [sent[0]] * d
        assert stats.bytes == latent_bytes * d  # each decode rank reads its own whole copy
        got.append(_decode(prefill, decode, rid, first, len(blocks)))
    assert got == reference

"""KV transfer for a tensor-parallel worker: one NIXL agent per rank, each over its own KV shard.

A worker of N ranks runs rank 0 in its own process and ranks 1..N-1 as processes of it
(``engine/tp_ranks.py``); ``EXTENSION`` gives each of those ranks the handlers below, reached by
``TpGroup.call`` (rank 0 asks, every rank acts on its own shard, the replies come back in rank order):

- ``open_source`` (prefill): every rank registers its KV shard with a ``KvSource`` of its own (agent
  ``<name>-r<rank>``, layout ``rank_layout``: its KV head range, TP size and rank); the worker's
  ``AgentInfo`` is rank 0's with the others' in ``tp_ranks``. Leases and notifications stay with rank
  0: block ids are the same on every rank, and decode notifies rank 0 only.
- ``GroupSink`` (decode): ``connect`` runs ``KvSink.connect`` on every rank (each adds the source
  ranks holding its heads, ``transfer/heads.py``; an incompatible pair is ``IncompatibleKvError`` at
  the handshake on rank 0); ``read`` runs every rank's READs at once (rank 0's in a thread, the
  group's lock held, so no step runs meanwhile: the other ranks are busy reading), then, when every
  rank has its bytes, rank 0 sends the ``done`` notification that ends prefill's lease. A rank whose
  read fails fails the whole read (``TransferError`` with that rank's outcome); nothing is freed,
  so the caller may retry or release, as with ``KvSink``.
- ``block_bytes``: each rank's K/V bytes of some blocks (tests compare them with the source's heads).

A worker of one rank uses ``KvSource`` / ``KvSink`` directly; ``open_source`` and ``open_sink``
choose.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping

import msgspec
import torch

from engine.engine import LLMEngine
from engine.kv_groups import describe
from engine.model_runner import ModelRunner
from engine.tp_group import CallReply, TpGroup
from messages.codec import pack, unpack
from transfer.errors import IncompatibleKvError, TransferError
from transfer.nixl_sink import KvSink
from transfer.nixl_source import KvSource
from transfer.wire import AgentInfo, KvHandle, KvLayout, TransferStats

EXTENSION = "worker.tp_kv:RankKv"


class OpenKv(msgspec.Struct, frozen=True):
    role: str  # "source" | "sink"
    agent_name: str  # rank 0's; a rank's agent adds "-r<rank>"
    model: str


class ReadOrder(msgspec.Struct, frozen=True):
    handle: KvHandle
    remote_block_ids: list[int]
    local_block_ids: list[int]
    timeout: float
    slots: list[int] | None = None  # a hybrid model's KV group of each block (transfer/read_plan.py)


class KvFailure(msgspec.Struct, tag="failure", frozen=True):
    kind: str  # "incompatible" | "transfer"
    label: str  # the incompatible field, or the transfer outcome
    message: str


class Stats(msgspec.Struct, tag="stats", frozen=True):
    stats: TransferStats


def rank_layout(runner: ModelRunner, model: str) -> KvLayout:
    """The ``KvLayout`` of this rank's KV shard (its heads, its rank and the group's size)."""
    layout = KvLayout.from_tensor(runner.kv_cache, model, runner.kv_scales,
                                  describe(runner.model_config, runner.kv_groups), runner.model.numerics,
                                  runner.config.kv_compression)
    shard = runner.model.shard
    return layout.sharded(shard.size, shard.rank, shard.kv_head_range[0], runner.model_config.num_kv_heads)


def rank_agent_name(agent_name: str, rank: int) -> str:
    return agent_name if rank == 0 else f"{agent_name}-r{rank}"


def _guarded(action: Callable[[], bytes]) -> bytes:
    """``action()``, its KV failures as a ``KvFailure`` reply (the other exceptions: ``CallReply.error``)."""
    try:
        return action()
    except IncompatibleKvError as exc:
        return pack(KvFailure("incompatible", exc.field, str(exc)))
    except TransferError as exc:
        return pack(KvFailure("transfer", exc.outcome, str(exc)))


class RankKv:
    """A follower rank's KV agent (``EXTENSION``): built in the rank's process by ``engine/tp_ranks.py``."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.source: KvSource | None = None
        self.sink: KvSink | None = None
        self.handlers: Mapping[str, Callable[[bytes], bytes]] = {
            "kv.open": self._open, "kv.connect": self._connect, "kv.disconnect": self._disconnect,
            "kv.read": self._read,
            "kv.blocks": lambda data: block_bytes(self.runner, unpack(data, list[int])),
        }

    @property
    def rank(self) -> int:
        return self.runner.model.shard.rank

    def _open(self, data: bytes) -> bytes:
        order = unpack(data, OpenKv)
        layout = rank_layout(self.runner, order.model)
        name = rank_agent_name(order.agent_name, self.rank)
        kv, scales = self.runner.kv_cache, self.runner.kv_scales
        if order.role == "source":
            # rank 0 holds the leases; this rank cannot tell when a sink reads, so it always progresses
            self.source = self.source or KvSource(kv, layout, name, scales=scales,
                                                  always_in_flight=self.rank > 0)
            return pack(self.source.agent_info())
        self.sink = self.sink or KvSink(kv, layout, name, scales=scales)
        return b""

    def _live_sink(self) -> KvSink:
        if self.sink is None:
            raise RuntimeError(f"rank {self.rank} has no KV sink (kv.open first)")
        return self.sink

    def _connect(self, data: bytes) -> bytes:
        return _guarded(lambda: _connected(self._live_sink(), unpack(data, AgentInfo)))

    def _disconnect(self, data: bytes) -> bytes:
        self._live_sink().disconnect(data.decode())
        return b""

    def _read(self, data: bytes) -> bytes:
        o = unpack(data, ReadOrder)
        return _guarded(lambda: pack(Stats(self._live_sink().read_blocking(
            o.handle, o.remote_block_ids, o.local_block_ids, o.timeout, notify=False, slots=o.slots))))

    def close(self) -> None:
        for agent in (self.source, self.sink):
            if agent is not None:
                agent.close()


def _connected(sink: KvSink, info: AgentInfo) -> bytes:
    sink.connect(info)
    return b""


def block_bytes(runner: ModelRunner, blocks: list[int]) -> bytes:
    """This rank's K/V bytes of ``blocks`` (every layer), as ``kv_cache[:, blocks]`` lays them out."""
    return runner.kv_cache[:, blocks].contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def _replies(replies: list[CallReply], what: str) -> list[bytes]:
    """Each rank's reply data; a rank whose handler raised is a ``RuntimeError`` naming it."""
    for rank, reply in enumerate(replies):
        if reply.error:
            raise RuntimeError(f"{what} failed on tensor-parallel rank {rank}: {reply.error}")
    return [reply.data for reply in replies]


def _raise_failures(datas: list[bytes]) -> None:
    for rank, data in enumerate(datas):
        if not data:
            continue
        result = unpack(data, KvFailure | Stats)
        if isinstance(result, KvFailure):
            message = f"rank {rank}: {result.message}"
            if result.kind == "incompatible":
                raise IncompatibleKvError(result.label, message)
            raise TransferError(result.label, message)


def _group(engine: LLMEngine) -> TpGroup | None:
    group = engine.runner.group
    return group if group is not None and group.size > 1 else None


def open_source(engine: LLMEngine, agent_name: str) -> tuple[KvSource, AgentInfo]:
    """Rank 0's ``KvSource`` (leases live there) and the worker's ``AgentInfo`` (every rank's agent)."""
    layout = rank_layout(engine.runner, engine.model_config.name)
    source = KvSource(engine.runner.kv_cache, layout, agent_name, scales=engine.runner.kv_scales)
    group = _group(engine)
    if group is None:
        return source, source.agent_info()
    order = pack(OpenKv("source", agent_name, engine.model_config.name))
    datas = _replies(group.call("kv.open", order, lambda: b""), "opening the KV source")
    others = [unpack(data, AgentInfo) for data in datas[1:]]
    return source, msgspec.structs.replace(source.agent_info(), tp_ranks=others)


def open_sink(engine: LLMEngine, agent_name: str) -> KvSink | GroupSink:
    """A ``KvSink`` for a worker of one rank, a ``GroupSink`` over every rank's otherwise."""
    layout = rank_layout(engine.runner, engine.model_config.name)
    sink = KvSink(engine.runner.kv_cache, layout, agent_name, scales=engine.runner.kv_scales)
    group = _group(engine)
    if group is None:
        return sink
    order = pack(OpenKv("sink", agent_name, engine.model_config.name))
    _replies(group.call("kv.open", order, lambda: b""), "opening the KV sink")
    return GroupSink(group, sink)


def group_block_bytes(engine: LLMEngine, blocks: list[int]) -> list[bytes]:
    """Every rank's K/V bytes of ``blocks`` (rank order; see ``block_bytes``)."""
    group = _group(engine)
    if group is None:
        return [block_bytes(engine.runner, blocks)]
    return _replies(group.call("kv.blocks", pack(blocks), lambda: block_bytes(engine.runner, blocks)),
                    "reading KV blocks")


class GroupSink:
    """The decode side of a tensor-parallel worker: ``KvSink``'s calls, run on every rank."""

    def __init__(self, group: TpGroup, sink: KvSink) -> None:
        self.group = group
        self.sink = sink  # rank 0's
        self.backend = sink.backend

    def connect(self, info: AgentInfo) -> None:
        datas = _replies(self.group.call("kv.connect", pack(info), lambda: _guarded(
            lambda: _connected(self.sink, info))), "connecting to a KV source")
        _raise_failures(datas)

    def disconnect(self, agent_name: str) -> None:
        def local() -> bytes:
            self.sink.disconnect(agent_name)
            return b""

        _replies(self.group.call("kv.disconnect", agent_name.encode(), local), "disconnecting")

    def inject_failures(self, n: int) -> None:
        self.sink.inject_failures(n)

    def inject_failure_rate(self, rate: float, seed: int = 0) -> None:
        self.sink.inject_failure_rate(rate, seed)

    def release(self, handle: KvHandle) -> None:
        self.sink.release(handle)

    def close(self) -> None:
        self.sink.close()

    async def read(self, handle: KvHandle, remote_block_ids: list[int], local_block_ids: list[int],
                   timeout: float, slots: list[int] | None = None) -> TransferStats:
        return await asyncio.to_thread(self.read_blocking, handle, remote_block_ids, local_block_ids, timeout,
                                       slots)

    def read_blocking(self, handle: KvHandle, remote_block_ids: list[int], local_block_ids: list[int],
                      timeout: float, slots: list[int] | None = None) -> TransferStats:
        """Every rank reads its heads of the blocks; then rank 0 notifies the source (see the module doc)."""
        order = pack(ReadOrder(handle, remote_block_ids, local_block_ids, timeout, slots))

        def local() -> bytes:
            return pack(Stats(self.sink.read_blocking(handle, remote_block_ids, local_block_ids, timeout,
                                                      notify=False, slots=slots)))

        datas = _replies(self.group.call("kv.read", order, lambda: _guarded(local)), "a KV read")
        _raise_failures(datas)
        parts = [unpack(data, Stats).stats for data in datas]
        self.sink.notify_done(handle)
        return TransferStats(parts[0].blocks, sum(p.bytes for p in parts), sum(p.descriptors for p in parts),
                             max(p.seconds for p in parts), self.backend, sum(p.staged_bytes for p in parts))

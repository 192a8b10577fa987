"""Which KV heads a sink rank reads from which source rank, across two tensor-parallel sizes.

A source worker of ``a`` ranks and a sink worker of ``b`` ranks hold the same model's ``K`` KV heads
split by ``engine/tensor_parallel.py``'s rule (each rank's heads are in its ``KvLayout``:
``kv_head_range``; a head may sit on several ranks when a size exceeds ``K``). ``head_reads`` gives,
for one sink rank, the runs of global heads it needs and the source rank each run is read from:
every head it holds, from a source rank that holds it (among several, the one at ``sink rank mod
holders``, so replicated heads spread the reads), consecutive heads from one rank merged into one
run. Pure arithmetic over layouts; ``KvSink`` turns runs into descriptors.
"""

from __future__ import annotations

from dataclasses import dataclass

from transfer.errors import IncompatibleKvError
from transfer.wire import KvLayout


@dataclass(frozen=True)
class HeadRun:
    """Global KV heads ``[start, stop)`` read from source rank ``source`` (index into the group)."""

    source: int
    start: int
    stop: int


def head_reads(sink: KvLayout, sources: list[KvLayout]) -> list[HeadRun]:
    """The runs ``sink`` reads from ``sources`` (a worker's ranks, rank order); ``IncompatibleKvError``
    when the group is incomplete or does not hold a head the sink needs."""
    if [s.tp_rank for s in sources] != list(range(len(sources))) or any(
            s.tp_size != len(sources) for s in sources):
        raise IncompatibleKvError(
            "tp_size", f"the KV source group is incomplete: ranks {[s.tp_rank for s in sources]} of "
                       f"{[s.tp_size for s in sources]}")
    runs: list[HeadRun] = []
    for head in range(*sink.kv_head_range):
        holders = [i for i, s in enumerate(sources) if s.kv_head_range[0] <= head < s.kv_head_range[1]]
        if not holders:
            raise IncompatibleKvError(
                "kv_head_range", f"no rank of the KV source (tp_size {len(sources)}) holds KV head {head} "
                                 f"that sink rank {sink.tp_rank} of {sink.tp_size} needs")
        source = holders[sink.tp_rank % len(holders)]
        if runs and runs[-1].source == source and runs[-1].stop == head:
            runs[-1] = HeadRun(source, runs[-1].start, head + 1)
        else:
            runs.append(HeadRun(source, head, head + 1))
    return runs


def whole_rows(run: HeadRun, sink: KvLayout, source: KvLayout) -> bool:
    """True when ``run`` is every head of both caches: a block's region is then copied whole."""
    return (run.start, run.stop) == sink.kv_head_range == source.kv_head_range

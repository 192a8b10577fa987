"""What rank 0 of a tensor-parallel group sends the other ranks (``engine/tp_group.py``), as plain frozen
dataclasses: the engine builds and reads them with no codec imported. ``engine/tp_wire.py`` turns them into
bytes and back (msgspec), and is imported only by a group of more than one rank."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class StepPlan:
    """What every rank needs to run one step's forward: flat tokens, positions, per-sequence lengths and
    block tables (identical block ids on every rank), the rows to compute logits for."""

    input_ids: list[int]
    positions: list[int]
    query_lens: list[int]
    seq_lens: list[int]
    tables: list[list[int]]  # KV group 0's table of each sequence
    sample_rows: list[int]
    group_tables: list[list[list[int]]] = field(default_factory=list)  # a hybrid model's other groups


@dataclass(frozen=True)
class KeepAlive:
    pass


@dataclass(frozen=True)
class Stop:
    pass


@dataclass(frozen=True)
class Call:
    """Run the handler ``name`` on every rank with ``payload``; each answers a ``CallReply``."""

    name: str
    payload: bytes


@dataclass(frozen=True)
class CallReply:
    data: bytes = b""
    error: str = ""  # non-empty: the handler raised (type and message)


Plan = StepPlan | KeepAlive | Stop | Call


def run_handler(handler: Callable[[], bytes]) -> CallReply:
    """``handler()``'s bytes as a reply; an exception it raises as the reply's ``error``."""
    try:
        return CallReply(handler())
    except Exception as exc:  # noqa: BLE001 - every rank must answer the gather, whatever happened
        return CallReply(error=f"{type(exc).__name__}: {exc}")

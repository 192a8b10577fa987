"""KV transfer between prefill and decode: wire types, compatibility hash, NIXL source and sink.

See ``transfer/nixl_source.py`` (leases, who frees what) and ``transfer/nixl_sink.py``
(handshake, READ, notifications, deadlines) for the contract. The NIXL classes are
imported lazily so that ``transfer.wire`` stays importable without NIXL (the router).
"""

from __future__ import annotations

from transfer.compat import compat_hash
from transfer.errors import IncompatibleKvError, TransferError
from transfer.wire import WIRE_VERSION, AgentInfo, KvHandle, KvLayout, TransferStats

__all__ = [
    "WIRE_VERSION",
    "AgentInfo",
    "IncompatibleKvError",
    "KvHandle",
    "KvLayout",
    "TransferError",
    "TransferStats",
    "compat_hash",
]

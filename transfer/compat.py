"""The KV compatibility hash, and the field-by-field check behind it.

Two peers may exchange KV blocks only when every byte of a block means the same
thing on both sides: same model, dtype, block size, layer count, KV heads, head
dimension, element size, KV storage dtype (``dtype``: fp8/int8 or the model dtype)
and scale region size, the same in-memory layout (``LAYOUT_NAME``) and the same
wire version. ``num_blocks`` is deliberately left out: each worker sizes its own
pool. The hash is checked once, when a sink connects to a source.
"""

from __future__ import annotations

import hashlib

from transfer.errors import IncompatibleKvError
from transfer.wire import WIRE_VERSION, AgentInfo, KvLayout

LAYOUT_NAME = "NHD-paged-v1"
COMPAT_FIELDS = ("model", "dtype", "block_size", "num_layers", "num_kv_heads", "head_dim", "element_size",
                 "scale_region_bytes")


def compat_hash(layout: KvLayout) -> str:
    parts = [f"layout={LAYOUT_NAME}", f"wire_version={WIRE_VERSION}"]
    parts += [f"{name}={getattr(layout, name)!r}" for name in COMPAT_FIELDS]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def check_compatible(local: KvLayout, remote: AgentInfo) -> None:
    """Raise ``IncompatibleKvError`` naming the first field that differs."""
    who = f"KV peer {remote.agent_name!r} is incompatible"
    if remote.wire_version != WIRE_VERSION:
        raise IncompatibleKvError(
            "wire_version",
            f"{who}: wire_version differs (local {WIRE_VERSION}, remote {remote.wire_version})",
        )
    for name in COMPAT_FIELDS:
        mine, theirs = getattr(local, name), getattr(remote.layout, name)
        if mine != theirs:
            raise IncompatibleKvError(name, f"{who}: {name} differs (local {mine!r}, remote {theirs!r})")
    local_hash = compat_hash(local)
    if remote.compat_hash != local_hash:
        raise IncompatibleKvError(
            "compat_hash",
            f"{who}: compat_hash differs with equal layout fields (local {local_hash[:12]}, "
            f"remote {remote.compat_hash[:12]}): layout name or hash version differ",
        )

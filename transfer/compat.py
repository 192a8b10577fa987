"""The KV compatibility hash, and the field-by-field check behind it.

Two peers may exchange KV blocks only when every byte of a block means the same
thing on both sides: same model, dtype, block size, layer count (a hybrid model's
slots), head dimension (latent attention's latent and rotary widths together), parts
(K and V, or one latent), the KV groups' description (which layers share a block
table, their windows; latent attention's split of its row), element size, KV storage
dtype (``dtype``: fp8/int8 or the model dtype), the numerics of the products that
computed the K/V (``numerics``: float32, int8 activations over GGUF blocks, or
bfloat16), what frees a running sequence's blocks (``kv_compression``: a sliding window
with sinks, heavy-hitter eviction and their sizes; a compressed sequence crosses as it
is and goes on being compressed by the same rule), the model's KV heads, the same
in-memory layout (``LAYOUT_NAME``) and the same wire version. ``num_blocks`` is
deliberately left out: each worker sizes its own pool.

Tensor parallelism: a peer's hash also covers its shard, ``tp_size``, ``tp_rank``
and its KV head range, so a handle's hash names exactly the layout it was made
for. Peers of different TP sizes hold different head ranges and so different
hashes; they are compatible when the shared fields agree (``check_compatible``)
and the sink's heads are all held by the source's ranks (``transfer/heads.py``,
checked at connect). A quantized cache (scale regions) moves only between equal
head ranges. The checks run once, when a sink connects to a source.
"""

from __future__ import annotations

import hashlib

from transfer.errors import IncompatibleKvError
from transfer.wire import WIRE_VERSION, AgentInfo, KvLayout

LAYOUT_NAME = "NHD-paged-v1"
SHARED_FIELDS = ("model", "dtype", "block_size", "num_layers", "model_kv_heads", "head_dim", "element_size",
                 "parts", "kv_groups", "numerics", "kv_compression")
SHARD_FIELDS = ("tp_size", "tp_rank", "kv_head_start", "num_kv_heads", "scale_region_bytes")


def compat_hash(layout: KvLayout) -> str:
    parts = [f"layout={LAYOUT_NAME}", f"wire_version={WIRE_VERSION}"]
    parts += [f"{name}={getattr(layout, name)!r}" for name in SHARED_FIELDS + SHARD_FIELDS]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def check_compatible(local: KvLayout, remote: AgentInfo) -> None:
    """Raise ``IncompatibleKvError`` naming the first field that differs."""
    who = f"KV peer {remote.agent_name!r} is incompatible"
    if remote.wire_version != WIRE_VERSION:
        raise IncompatibleKvError(
            "wire_version",
            f"{who}: wire_version differs (local {WIRE_VERSION}, remote {remote.wire_version})",
        )
    for name in SHARED_FIELDS:
        mine, theirs = getattr(local, name), getattr(remote.layout, name)
        if mine != theirs:
            field = "num_kv_heads" if name == "model_kv_heads" else name
            raise IncompatibleKvError(field, f"{who}: {field} differs (local {mine!r}, remote {theirs!r})")
    theirs_scales = remote.layout.scale_region_bytes
    if local.kv_head_range == remote.layout.kv_head_range:
        if local.scale_region_bytes != theirs_scales:
            raise IncompatibleKvError("scale_region_bytes", f"{who}: scale_region_bytes differs (local "
                                      f"{local.scale_region_bytes!r}, remote {theirs_scales!r})")
    elif local.scale_region_bytes or theirs_scales:
        raise IncompatibleKvError(
            "scale_region_bytes", f"{who}: a quantized KV cache (scale regions) moves only between equal "
                                  f"KV head ranges (local {local.kv_head_range}, remote "
                                  f"{remote.layout.kv_head_range}: tp_size {local.tp_size} vs "
                                  f"{remote.layout.tp_size})")
    if remote.compat_hash != compat_hash(remote.layout):
        raise IncompatibleKvError(
            "compat_hash",
            f"{who}: its compat_hash does not match its layout (remote {remote.compat_hash[:12]}): layout "
            f"name or hash version differ",
        )

"""Wire types of the KV transfer layer (msgspec msgpack; never pickle).

Every type is a frozen ``msgspec.Struct``; ``encode`` / ``decode`` are the only way
they cross a process boundary. ``WIRE_VERSION`` changes whenever a field changes
meaning; peers with different versions refuse each other at the handshake.

- ``KvLayout`` describes one worker's KV cache tensor (see ``kernels/attention.py``):
  ``[num_layers, num_blocks, parts, block_size, num_kv_heads, head_dim]``, contiguous, so
  region ``(layer, block)`` starts at ``base_addr + (layer * num_blocks + block) *
  region_bytes``. A quantized cache (fp8/int8, ``kernels/kv_quant.py``) also has a
  scales tensor ``[num_layers, num_blocks, 2, num_kv_heads]`` float32 (int4, stored as ``uint8`` two codes
  a byte with ``head_dim`` counting bytes: ``[..., num_kv_heads, groups, 2]``, ``scale_tail`` the
  dimensions after the heads, ``kernels/kv_int4.py``); its region
  ``(layer, block)`` (``scale_region_bytes`` long, 0 when there are no scales) starts
  at ``scales_addr + (layer * num_blocks + block) * scale_region_bytes`` and moves
  with the block's K/V region in the same READ.
  With tensor parallelism each rank's cache holds only its KV heads: ``num_kv_heads`` of the model's
  ``total_kv_heads``, starting at global head ``kv_head_start``, on rank ``tp_rank`` of ``tp_size``
  (``engine/tensor_parallel.py`` decides which; one head may be replicated on several ranks). The
  defaults describe an unsharded cache. ``parts`` is 2 (K and V) or 1 (latent attention's one row
  per token, its one "head" ``head_dim`` values wide). A hybrid model's ``num_layers`` are the slots
  of its KV groups (``engine/kv_groups.py``; ``kv_groups`` says which), and a group's block holds its
  layers in the first slots: a read of such a block moves only those. ``numerics`` names the
  arithmetic of the products that wrote the K/V (``int8``: products over GGUF blocks that quantize their
  activations; ``bf16``: bfloat16 products, ``--dtype bfloat16`` on CPU; ``float32``); peers must agree
  on it as on ``dtype``.
- ``AgentInfo`` is what a source publishes once (NIXL metadata, the tensor's address
  and layout); a sink connects to it before its first read. A tensor-parallel worker publishes its
  rank 0's, with ranks 1..N-1's in ``tp_ranks`` (rank order): one agent per rank, each registering
  its own KV shard.
- ``KvHandle`` is what prefill hands decode per request: which source agent holds the
  blocks (rank 0's for a tensor-parallel worker: block ids are the same on every rank), which
  blocks (every KV group's table; a sliding group's blocks its window left are -1, never read),
  and until when (``lease_deadline``, ``time.time()`` seconds).
- ``TransferStats`` is what one read moved and how long it took: ``bytes`` placed in the cache,
  ``staged_bytes`` of them (and any more) read through a staging buffer first.

They cross processes through ``messages.codec.pack`` / ``unpack``, like every message.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

if TYPE_CHECKING:
    import torch

WIRE_VERSION: int = 7


class KvLayout(msgspec.Struct, frozen=True):
    model: str
    dtype: str
    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    element_size: int
    scale_region_bytes: int = 0
    tp_size: int = 1
    tp_rank: int = 0
    kv_head_start: int = 0
    total_kv_heads: int = 0  # 0: num_kv_heads (an unsharded cache)
    parts: int = 2  # K and V; 1 for latent attention's one row (its "head" the latent and rotary key)
    kv_groups: str = ""  # engine/kv_groups.py's describe(): which layers share a block table; "": one
    scale_tail: tuple[int, ...] = ()  # the scales' dimensions after kv_heads: int4's (groups, 2)
    # the arithmetic of the products (CausalLM.numerics: float32, int8 activations over GGUF blocks, bf16):
    # K/V computed by different products differ, so both sides of a transfer must agree
    numerics: str = "float32"
    # what frees a running sequence's blocks (EngineConfig.kv_compression): a sequence handed over with
    # blocks already dropped goes on being compressed by the same rule on the other side
    kv_compression: str = ""

    @property
    def model_kv_heads(self) -> int:
        """The model's KV heads (every rank's shard together)."""
        return self.total_kv_heads or self.num_kv_heads

    @property
    def kv_head_range(self) -> tuple[int, int]:
        """The global KV heads this cache holds, ``[start, stop)``."""
        return self.kv_head_start, self.kv_head_start + self.num_kv_heads

    def sharded(self, tp_size: int, tp_rank: int, kv_head_start: int, total_kv_heads: int) -> KvLayout:
        """This layout as rank ``tp_rank`` of ``tp_size``'s shard of ``total_kv_heads`` heads."""
        if not 0 <= kv_head_start <= total_kv_heads - self.num_kv_heads:
            raise ValueError(f"KV heads [{kv_head_start}, {kv_head_start + self.num_kv_heads}) outside the "
                             f"model's {total_kv_heads}")
        return msgspec.structs.replace(self, tp_size=tp_size, tp_rank=tp_rank, kv_head_start=kv_head_start,
                                       total_kv_heads=total_kv_heads)

    @property
    def region_bytes(self) -> int:
        """Bytes of one block of one layer (K and V, or the latent)."""
        return self.parts * self.block_size * self.num_kv_heads * self.head_dim * self.element_size

    @property
    def total_bytes(self) -> int:
        return self.num_layers * self.num_blocks * (self.region_bytes + self.scale_region_bytes)

    @property
    def scales_shape(self) -> tuple[int, ...]:
        return (self.num_layers, self.num_blocks, self.parts, self.num_kv_heads, *self.scale_tail)

    @property
    def shape(self) -> tuple[int, int, int, int, int, int]:
        return (self.num_layers, self.num_blocks, self.parts, self.block_size, self.num_kv_heads,
                self.head_dim)

    @staticmethod
    def from_tensor(kv_cache: torch.Tensor, model: str, scales: torch.Tensor | None = None,
                    kv_groups: str = "", numerics: str = "float32",
                    kv_compression: str = "") -> KvLayout:
        """The layout of a KV cache tensor shaped as ``kernels/attention.py`` describes (and its scales);
        ``kv_groups`` describes a hybrid model's groups (``engine/kv_groups.py:describe``),
        ``numerics`` the arithmetic of the model's products (``CausalLM.numerics``), ``kv_compression``
        what frees a running sequence's blocks."""
        if kv_cache.dim() != 6 or kv_cache.shape[2] not in (1, 2):
            raise ValueError(f"not a paged KV cache tensor: shape {tuple(kv_cache.shape)}")
        num_layers, num_blocks, parts, block_size, num_kv_heads, head_dim = kv_cache.shape
        scale_region_bytes = 0
        scale_tail: tuple[int, ...] = ()
        if scales is not None:
            if tuple(scales.shape[:4]) != (num_layers, num_blocks, parts, num_kv_heads):
                raise ValueError(f"KV scales shape {tuple(scales.shape)} does not match the cache")
            scale_tail = tuple(scales.shape[4:])
            scale_region_bytes = scales[0, 0].numel() * scales.element_size()
        dtype = str(kv_cache.dtype).removeprefix("torch.")
        return KvLayout(
            model=model,
            dtype="int4" if dtype == "uint8" else dtype,  # kernels/kv_int4.py stores int4 as uint8 bytes
            num_layers=num_layers,
            num_blocks=num_blocks,
            block_size=block_size,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            element_size=kv_cache.element_size(),
            scale_region_bytes=scale_region_bytes,
            parts=parts,
            kv_groups=kv_groups,
            scale_tail=scale_tail,
            numerics=numerics,
            kv_compression=kv_compression,
        )


class AgentInfo(msgspec.Struct, frozen=True):
    wire_version: int
    compat_hash: str
    agent_name: str
    metadata: bytes
    base_addr: int
    device_id: int
    mem_type: str  # "DRAM" or "VRAM"
    layout: KvLayout
    scales_addr: int = 0  # base of the scales tensor when layout.scale_region_bytes > 0
    tp_ranks: list[AgentInfo] = []  # a tensor-parallel worker's ranks 1..N-1 (this is rank 0's)

    @property
    def group(self) -> list[AgentInfo]:
        """Every rank's agent, rank 0 first."""
        return [self, *self.tp_ranks]


class KvHandle(msgspec.Struct, frozen=True):
    request_id: str
    agent_name: str
    block_ids: list[int]  # KV group 0's table (``engine/kv_groups.py``; -1: a block its window left)
    num_tokens: int
    compat_hash: str
    lease_deadline: float  # time.time() epoch seconds
    group_block_ids: list[list[int]] = []  # a hybrid model's other groups' tables, likewise
    # a compressed sequence (KvLayout.kv_compression): prompt tokens whose blocks were freed before the
    # handoff; ``block_ids`` then lists the kept blocks in table order, ``num_tokens - dropped_tokens``
    # tokens (positions stay the tokens' own: K is stored after rotary)
    dropped_tokens: int = 0
    # --kv-eviction: each block's attention mass so far per layer and KV head (layers x kv_heads values a
    # block, in block_ids' order)
    block_mass: list[float] = []


class TransferStats(msgspec.Struct, frozen=True):
    blocks: int
    bytes: int
    descriptors: int
    seconds: float
    backend: str
    staged_bytes: int = 0  # bytes READ into a staging buffer (``transfer/staging.py``) first

    @property
    def gb_per_s(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

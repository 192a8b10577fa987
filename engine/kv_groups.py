"""KV layer groups: which layers share a block table, and how many slots a block holds.

A model whose layers all attend to everything has one group: every layer, one block table per
sequence, and a block holds one slot per layer (the cache tensor ``[num_layers, num_blocks, ...]``).
A hybrid model (Gemma 3's five sliding layers to one global, gpt-oss's alternating 128-token
windows) splits its layers by attention kind into groups of ``slots`` layers each, ``slots`` being the
smaller kind's layer count (the larger kind's last group padded with empty slots): every group has a
block table of its own, all draw blocks from one pool, and block ``b`` of group ``g`` holds layer
``group.layers[s]``'s K/V in slot ``s`` of the cache tensor ``[slots, num_blocks, ...]``. A sliding
group's table keeps only the blocks its window can still read: the others are released to the pool
(``NULL_BLOCK`` takes their place) as the sequence grows, so its memory per sequence stops growing at
about the window. This is the hybrid allocator of vLLM v1, in one pool of equal-sized blocks.

Everything here is arithmetic over ``ModelConfig``; ``engine/kv_cache.py`` keeps the tables.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass

from engine.config import ModelConfig

NULL_BLOCK = -1  # a sliding group's table entry whose block its window has left


@dataclass(frozen=True)
class KvGroup:
    """Layers that share one block table: all full attention (``window`` None) or one sliding window."""

    layers: tuple[int, ...]  # the model's layer indices, in slot order
    window: int | None = None

    def held_blocks(self, tokens: int, block_size: int) -> int:
        """Blocks this group holds for a sequence of ``tokens`` tokens between steps."""
        full = math.ceil(tokens / block_size)
        if self.window is None:
            return full
        return min(full, math.ceil(self.window / block_size) + 1)

    def first_needed(self, next_position: int, block_size: int) -> int:
        """The first block the query at ``next_position`` still reads (0 for full attention)."""
        if self.window is None:
            return 0
        return max(0, next_position - self.window + 1) // block_size


def kv_groups(config: ModelConfig) -> tuple[KvGroup, ...]:
    """The model's groups, full-attention groups first (group 0 feeds the router's prefix index)."""
    kinds: dict[int | None, list[int]] = {}
    for layer in range(config.num_layers):
        kinds.setdefault(config.layer_window(layer), []).append(layer)
    if len(kinds) == 1:
        ((window, layers),) = kinds.items()
        return (KvGroup(tuple(layers), window),)
    slots = min(len(layers) for layers in kinds.values())
    ordered = sorted(kinds.items(), key=lambda kv: (kv[0] is not None, kv[0] or 0))
    return tuple(KvGroup(tuple(layers[i : i + slots]), window)
                 for window, layers in ordered for i in range(0, len(layers), slots))


def num_slots(groups: tuple[KvGroup, ...]) -> int:
    """Slots a block holds: the largest group's layer count."""
    return max(len(g.layers) for g in groups)


def layer_slots(groups: tuple[KvGroup, ...], num_layers: int) -> tuple[list[int], list[int]]:
    """For each layer, its group and its slot."""
    group_of, slot_of = [0] * num_layers, [0] * num_layers
    for g, group in enumerate(groups):
        for s, layer in enumerate(group.layers):
            group_of[layer], slot_of[layer] = g, s
    return group_of, slot_of


def blocks_per_sequence(groups: tuple[KvGroup, ...], tokens: int, block_size: int) -> int:
    """Blocks one sequence of ``tokens`` tokens holds, every group together."""
    return sum(g.held_blocks(tokens, block_size) for g in groups)


def kv_layout(config: ModelConfig, hybrid: bool = True) -> tuple[KvGroup, ...]:
    """The groups the engine keeps: ``kv_groups`` with the hybrid manager on; else one group of every
    layer whose blocks stay for the whole sequence (a sliding layer still masks to its window; it only
    keeps blocks it no longer reads)."""
    if hybrid:
        return kv_groups(config)
    return (KvGroup(tuple(range(config.num_layers))),)


def max_sequence_tokens(groups: tuple[KvGroup, ...], num_blocks: int, block_size: int) -> int:
    """The longest sequence ``num_blocks`` blocks hold on their own (every group's table), with room for
    one more block per sliding group (its window's next block arrives before the oldest leaves); a
    model of sliding groups only is bounded by its windows, not its length (``sys.maxsize``)."""
    window_blocks = sum(g.held_blocks(sys.maxsize, block_size) + 1 for g in groups if g.window is not None)
    full = sum(1 for g in groups if g.window is None)
    if window_blocks > num_blocks:
        return 0
    if not full:
        return sys.maxsize
    return (num_blocks - window_blocks) // full * block_size


def describe(config: ModelConfig, groups: tuple[KvGroup, ...]) -> str:
    """What a KV block's bytes mean beyond its shape, for the transfer's compatibility hash: each
    group's layers and window, and latent attention's split of its row ("" for one full group of a
    model without latent attention)."""
    parts = []
    if len(groups) > 1 or groups[0].window is not None:
        parts.append(";".join(f"{','.join(map(str, g.layers))}@{g.window or 'full'}" for g in groups))
    if config.mla is not None:
        parts.append(f"mla:{config.mla.kv_lora_rank}+{config.mla.qk_rope_head_dim}")
    return " ".join(parts)

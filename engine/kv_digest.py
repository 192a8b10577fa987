"""A digest of the K/V a request holds, token by token, to compare caches across processes."""

from __future__ import annotations

import hashlib

import torch

from engine.engine import LLMEngine
from engine.kv_groups import NULL_BLOCK


def kv_digest(engine: LLMEngine, owner: str, num_tokens: int) -> str:
    """SHA-256 over every layer's K and V rows of ``owner``'s first ``num_tokens`` tokens, in order:
    KV group by group (``engine/kv_groups.py``), each group's layers slot by slot, the blocks a sliding
    group still holds only. A quantized cache's per-block scales are hashed after each block's rows.
    """
    bs = engine.kv.block_size
    cache = engine.runner.kv_cache
    scales = engine.runner.kv_scales
    h = hashlib.sha256()
    for group, blocks in zip(engine.kv.groups, engine.kv.tables_of(owner), strict=True):
        if len(blocks) * bs < num_tokens:
            raise ValueError(f"{owner!r} holds {len(blocks)} blocks, fewer than {num_tokens} tokens need")
        for slot in range(max(len(group.layers), 1) if engine.kv.hybrid else cache.shape[0]):
            for i, block in enumerate(blocks):
                used = min(bs, num_tokens - i * bs)
                if used <= 0:
                    break
                if block == NULL_BLOCK:
                    continue
                rows = cache[slot, block, :, :used].contiguous().cpu()
                h.update(rows.view(torch.uint8).numpy().tobytes())
                if scales is not None:
                    h.update(scales[slot, block].contiguous().cpu().numpy().tobytes())
    return h.hexdigest()

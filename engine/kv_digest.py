"""A digest of the K/V a request holds, token by token, to compare caches across processes."""

from __future__ import annotations

import hashlib

import torch

from engine.engine import LLMEngine


def kv_digest(engine: LLMEngine, owner: str, num_tokens: int) -> str:
    """SHA-256 over every layer's K and V rows of ``owner``'s first ``num_tokens`` tokens, in order.

    A quantized cache's per-block scales are hashed after each block's rows.
    """
    blocks = engine.kv.blocks_of(owner)
    bs = engine.kv.block_size
    if len(blocks) * bs < num_tokens:
        raise ValueError(f"{owner!r} holds {len(blocks)} blocks, fewer than {num_tokens} tokens need")
    cache = engine.runner.kv_cache
    scales = engine.runner.kv_scales
    h = hashlib.sha256()
    for layer in range(cache.shape[0]):
        for i, block in enumerate(blocks):
            used = min(bs, num_tokens - i * bs)
            if used <= 0:
                break
            rows = cache[layer, block, :, :used].contiguous().cpu()
            h.update(rows.view(torch.uint8).numpy().tobytes())
            if scales is not None:
                h.update(scales[layer, block].contiguous().cpu().numpy().tobytes())
    return h.hexdigest()

"""Decode batch-size buckets: a step's batch is padded up to the next bucket.

Buckets are 1, 2, 4, 8, then every 8 up to ``max_num_seqs`` (which is always the
last bucket), so a compiled or captured graph exists per bucket and a batch
pads by at most 7 rows above 8.
"""

from __future__ import annotations

from collections.abc import Sequence


def decode_buckets(max_num_seqs: int) -> list[int]:
    """Ascending bucket sizes covering ``1..max_num_seqs``."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be at least 1, got {max_num_seqs}")
    buckets = [b for b in (1, 2, 4, 8) if b < max_num_seqs]
    buckets += range(16, max_num_seqs, 8)
    buckets.append(max_num_seqs)
    return buckets


def padded_batch_size(n: int, buckets: Sequence[int]) -> int:
    """The smallest bucket holding ``n`` rows; ``n`` itself past the largest bucket."""
    for b in buckets:
        if b >= n:
            return b
    return n

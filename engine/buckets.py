"""Batch-size buckets: the batch sizes a step is padded to, so a fixed set of shapes covers every batch.

Used by decode CUDA graphs (``engine/cuda_graphs.py``, one graph per bucket) and by any
other per-shape compilation of the decode step. Buckets are ``1, 2, 4, 8`` and then every
8 up to ``max_num_seqs`` rounded up to a multiple of 8, at most ``cap``. A batch larger
than the last bucket has no bucket and runs unpadded.
"""

from __future__ import annotations

from collections.abc import Sequence

MAX_BUCKET = 512


def decode_buckets(max_num_seqs: int, cap: int = MAX_BUCKET) -> tuple[int, ...]:
    """Ascending bucket sizes for batches of up to ``max_num_seqs`` sequences."""
    if max_num_seqs < 1 or cap < 1:
        raise ValueError(f"max_num_seqs and cap must be >= 1, got {max_num_seqs} and {cap}")
    top = min(-(-max_num_seqs // 8) * 8, cap)
    small = [b for b in (1, 2, 4, 8) if b <= top]
    return tuple(small + list(range(16, top + 1, 8)) + ([top] if top not in small and top % 8 else []))


def padded_batch_size(n: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket holding ``n`` rows, or ``None`` when ``n`` exceeds every bucket."""
    if n < 1:
        raise ValueError(f"batch size must be >= 1, got {n}")
    for bucket in buckets:
        if bucket >= n:
            return bucket
    return None

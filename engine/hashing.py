"""Chained block hashes: the one prefix-hashing function of the project; and the one prefix cost.

The engine's prefix cache and the router's prefix index both import this module,
so a block hash means the same thing on every worker and in the router. The
router's prefix-aware policy and the planner's simulator both weigh a worker's
cached prefix with ``prefix_cost``, so the simulator routes as the router does.

A block is ``block_size`` consecutive token ids starting at a multiple of
``block_size``; only full blocks get a hash. The hash of block ``i`` covers its
own tokens and the hash of block ``i - 1`` (the root seed for block 0), so equal
hashes mean equal whole prefixes, not just equal blocks. Hashes are stable
across processes and Python versions (blake2b over little-endian int64 bytes),
64-bit unsigned integers.
"""

from __future__ import annotations

import hashlib
import struct
from array import array
from collections.abc import Sequence

ROOT_SEED = 0x9E3779B97F4A7C15


def seed_for(namespace: str) -> int:
    """A root seed that separates caches which must never share blocks (e.g. two models)."""
    digest = hashlib.blake2b(namespace.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def hash_block(parent: int, token_ids: Sequence[int]) -> int:
    """Hash of one full block given its parent's hash."""
    data = struct.pack("<Q", parent) + array("q", token_ids).tobytes()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    seed: int = ROOT_SEED,
    start: Sequence[int] = (),
) -> list[int]:
    """Chained hashes of every full block of ``token_ids``.

    ``start`` holds hashes already computed for the leading blocks (they are
    kept, not recomputed), so a growing sequence hashes only its new blocks.
    """
    hashes = list(start)
    parent = hashes[-1] if hashes else seed
    for begin in range(len(hashes) * block_size, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[begin : begin + block_size])
        hashes.append(parent)
    return hashes


def group_hash(block_hash: int, group: int) -> int:
    """The prefix-cache key of KV group ``group``'s block whose chained hash is ``block_hash``
    (``engine/kv_groups.py``): the hash itself for group 0, a separate 64-bit hash for the others, so
    two groups' blocks of the same tokens never stand for each other."""
    if group == 0:
        return block_hash
    data = struct.pack("<QQ", block_hash, group)
    return int.from_bytes(hashlib.blake2b(data, digest_size=8, person=b"pdserve-kvgroup").digest(), "little")


CACHE_WEIGHT = 2.0  # a prompt token a worker lacks weighs as this many tokens of its load


def prefix_cost(load_tokens: int, shared_load_tokens: int, prompt_tokens: int, prefix_tokens: int,
                weight: float = CACHE_WEIGHT) -> float:
    """The work, in tokens, a request adds to a worker holding ``prefix_tokens`` of its prompt: the
    tokens queued and running there less those computing this request's own prefix
    (``shared_load_tokens``: done once, and waited for wherever the request goes), plus ``weight``
    for each prompt token the worker lacks. Lower is better; ties go to the lower worker index."""
    return max(load_tokens - shared_load_tokens, 0) + weight * max(prompt_tokens - prefix_tokens, 0)

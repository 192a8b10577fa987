"""KV offload tiers: prefix-cache blocks evicted from the device live on in host memory and on disk.

When the block pool hands out a cached block (an eviction), ``store`` copies the
block's K/V (every layer, plus the scales of a quantized cache) under its chained
block hash (``engine/hashing.py``) into the host tier (``--kv-offload-bytes``). A
prefix lookup that misses on the device asks ``contains``; ``load`` returns the
bytes, and the KV manager copies them into a fresh device block and publishes it
under the same hash, so the prefix is restored instead of recomputed.

One LRU spans both tiers: a lookup hit or a store makes a block the most recent;
when the host tier is full its least recent block moves to the disk tier
(``--kv-offload-dir``, when set), and when the disk tier is full
(``--kv-offload-disk-bytes``) its least recent block is deleted. A restored block
leaves the tiers (it is on the device again; a later eviction stores it again).

Disk format: one plain file per block, ``<hash as 16 hex digits>.kv`` (the K/V bytes
then the scale bytes), written to a temporary name and renamed, plus
``index.json`` holding the compatibility fields (model, hash seed, KV dtype, block
shape). A new engine on the same directory keeps the files whose index matches its
own compatibility (their LRU order is their modification time) and deletes them
otherwise, so a worker restart keeps its disk hits and a different model or layout
never reads foreign bytes.
"""

from __future__ import annotations

import json
import os
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.kv_sizing import tier_capacity_blocks

INDEX_FILE = "index.json"
SUFFIX = ".kv"


@dataclass
class TierStats:
    host_blocks: int = 0
    disk_blocks: int = 0
    host_bytes: int = 0
    disk_bytes: int = 0
    stores: int = 0
    host_hits: int = 0
    disk_hits: int = 0


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t


class KvOffload:
    def __init__(
        self,
        kv_cache: torch.Tensor,
        kv_scales: torch.Tensor | None,
        host_bytes: int,
        disk_dir: str | None = None,
        disk_bytes: int = 8 * 1024**3,
        compat: dict[str, object] | None = None,
    ) -> None:
        self.kv_cache = kv_cache
        self.kv_scales = kv_scales
        self.host_capacity = host_bytes
        self.disk_capacity = disk_bytes if disk_dir else 0
        self.kv_bytes = kv_cache[:, 0].numel() * kv_cache.element_size()
        self.scale_bytes = kv_scales[:, 0].numel() * kv_scales.element_size() if kv_scales is not None else 0
        self.block_bytes = self.kv_bytes + self.scale_bytes
        self.stats = TierStats()
        self._lru: OrderedDict[int, str] = OrderedDict()  # hash -> "host" | "disk", least recent first
        self._host: dict[int, bytes] = {}
        self.disk_dir = Path(disk_dir) if disk_dir else None
        if self.disk_dir is not None:
            self._open_disk(dict(compat or {}))

    # -- public -----------------------------------------------------------------
    @property
    def host_capacity_blocks(self) -> int:
        """Blocks the host tier holds before its LRU moves one down (``--kv-offload-bytes`` // block)."""
        return tier_capacity_blocks(self.host_capacity, self.block_bytes)

    @property
    def disk_capacity_blocks(self) -> int:
        """Blocks the disk tier holds before its LRU deletes one (0 without ``--kv-offload-dir``)."""
        return tier_capacity_blocks(self.disk_capacity, self.block_bytes)

    def contains(self, block_hash: int) -> bool:
        return block_hash in self._lru

    def store(self, block_id: int, block_hash: int) -> None:
        """Copy device block ``block_id`` (about to be reused) into the host tier under ``block_hash``."""
        if self.host_capacity < self.block_bytes and self.disk_capacity < self.block_bytes:
            return
        if block_hash in self._lru:
            self._lru.move_to_end(block_hash)
            return
        data = _bytes(self.kv_cache[:, block_id]).contiguous().cpu().numpy().tobytes()
        if self.kv_scales is not None:
            data += self.kv_scales[:, block_id].contiguous().cpu().numpy().tobytes()
        self.stats.stores += 1
        if self.host_capacity >= self.block_bytes:
            self._put_host(block_hash, data)
        else:
            self._put_disk(block_hash, data)

    def restore(self, block_hash: int, block_id: int) -> bool:
        """Copy the stored block into device block ``block_id``; it leaves the tiers. False if gone."""
        tier = self._lru.pop(block_hash, None)
        if tier is None:
            return False
        if tier == "host":
            data = self._host.pop(block_hash)
            self.stats.host_blocks -= 1
            self.stats.host_bytes -= len(data)
            self.stats.host_hits += 1
        else:
            path = self._path(block_hash)
            try:
                data = path.read_bytes()
                path.unlink()
            except OSError:
                self._forget_disk(self.block_bytes)
                return False
            self._forget_disk(len(data))
            self.stats.disk_hits += 1
        if len(data) != self.block_bytes:
            return False
        raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        target = _bytes(self.kv_cache)
        kv = raw[: self.kv_bytes].view(target.dtype).view(target[:, block_id].shape)
        target[:, block_id].copy_(kv.to(target.device))
        if self.kv_scales is not None:
            scales = raw[self.kv_bytes :].view(self.kv_scales.dtype).view(self.kv_scales[:, block_id].shape)
            self.kv_scales[:, block_id].copy_(scales.to(self.kv_scales.device))
        return True

    # -- tiers ------------------------------------------------------------------
    def _put_host(self, block_hash: int, data: bytes) -> None:
        while self.stats.host_bytes + len(data) > self.host_capacity:
            oldest = next((h for h, t in self._lru.items() if t == "host"), None)
            if oldest is None:
                return
            moved = self._host.pop(oldest)
            del self._lru[oldest]
            self.stats.host_blocks -= 1
            self.stats.host_bytes -= len(moved)
            if self.disk_capacity >= len(moved):
                self._put_disk(oldest, moved)
        self._host[block_hash] = data
        self._lru[block_hash] = "host"
        self.stats.host_blocks += 1
        self.stats.host_bytes += len(data)

    def _put_disk(self, block_hash: int, data: bytes) -> None:
        if self.disk_dir is None or self.disk_capacity < len(data):
            return
        while self.stats.disk_bytes + len(data) > self.disk_capacity:
            oldest = next((h for h, t in self._lru.items() if t == "disk"), None)
            if oldest is None:
                return
            del self._lru[oldest]
            self._path(oldest).unlink(missing_ok=True)
            self._forget_disk(self.block_bytes)
        path = self._path(block_hash)
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)
        # disk entries sit before every host entry in LRU order (they are older)
        self._lru[block_hash] = "disk"
        self._lru.move_to_end(block_hash, last=False)
        self.stats.disk_blocks += 1
        self.stats.disk_bytes += len(data)

    def _forget_disk(self, nbytes: int) -> None:
        self.stats.disk_blocks -= 1
        self.stats.disk_bytes -= nbytes

    def _path(self, block_hash: int) -> Path:
        assert self.disk_dir is not None
        return self.disk_dir / f"{block_hash:016x}{SUFFIX}"

    def _open_disk(self, compat: dict[str, object]) -> None:
        assert self.disk_dir is not None
        self.disk_dir.mkdir(parents=True, exist_ok=True)
        compat = {**compat, "block_bytes": self.block_bytes, "kv_dtype": str(self.kv_cache.dtype),
                  "block_shape": list(self.kv_cache[:, 0].shape)}
        index = self.disk_dir / INDEX_FILE
        try:
            same = json.loads(index.read_text()) == compat
        except (OSError, ValueError):
            same = False
        files = sorted(self.disk_dir.glob(f"*{SUFFIX}"), key=lambda p: p.stat().st_mtime)
        for path in files:
            if not same or path.stat().st_size != self.block_bytes:
                path.unlink(missing_ok=True)
                continue
            try:
                block_hash = int(path.stem, 16)
            except ValueError:
                continue
            self._lru[block_hash] = "disk"
            self.stats.disk_blocks += 1
            self.stats.disk_bytes += self.block_bytes
        if not same:
            tmp = index.with_suffix(".tmp")
            tmp.write_text(json.dumps(compat))
            os.replace(tmp, index)

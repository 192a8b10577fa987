"""The sink's staging buffer: one tensor registered with NIXL that staged reads take turns on.

- ``register(agent)`` allocates ``nbytes`` on the cache's device and registers it, once, at the first
  connect to a source rank read by staging (``transfer/sink_handshake.py``); ``deregister`` at close.
- ``turn(handle, timeout)``: an async read that stages holds the buffer (an ``asyncio.Lock``) from
  posting its first chunk until its last is copied out; another waits its turn, at most until the
  read's deadline, ``min(now + timeout, handle.lease_deadline)`` (``TransferError`` ``"timeout"`` or
  ``"expired"``, whichever comes first). A blocking read refuses to start while a turn is held
  (``in_use``): both run on the worker's one thread, where it would wait forever.
- ``chunks(peer, remote_blocks, local_blocks)``: the staged READs of a read, as many blocks as fit each,
  in order, with their merged descriptor tables (``transfer/staging.py``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from transfer.errors import TransferError
from transfer.sink_handshake import Peer
from transfer.staging import blocks_per_chunk, chunks, read_tables
from transfer.wire import KvHandle

if TYPE_CHECKING:
    from nixl._api import nixl_agent


@dataclass
class StagedChunk:
    """One staged READ: every layer of ``remote_blocks`` of ``peer`` into staging, then ``local_blocks``."""

    peer: Peer
    remote_blocks: np.ndarray
    local_blocks: np.ndarray
    local_table: np.ndarray
    remote_table: np.ndarray


class StagingBuffer:
    """See the module docstring."""

    def __init__(self, nbytes: int, device: torch.device, device_id: int, backend: str) -> None:
        if nbytes <= 0:
            raise ValueError(f"staging_bytes must be > 0, got {nbytes}")
        self.nbytes = nbytes
        self.device_id = device_id
        self._device = device
        self._backend = backend
        self.tensor: torch.Tensor | None = None
        self._reg: Any = None
        self._lock = asyncio.Lock()

    def register(self, agent: nixl_agent) -> None:
        if self.tensor is None:
            self.tensor = torch.empty(self.nbytes, dtype=torch.uint8, device=self._device)
            self._reg = agent.register_memory(self.tensor, backends=[self._backend])

    def deregister(self, agent: nixl_agent) -> None:
        if self._reg is not None:
            agent.deregister_memory(self._reg, backends=[self._backend])
            self._reg = None

    @property
    def in_use(self) -> bool:
        return self._lock.locked()

    @asynccontextmanager
    async def turn(self, handle: KvHandle, timeout: float) -> AsyncIterator[None]:
        now = time.time()
        try:  # a free buffer is taken at once, whatever the deadline
            async with asyncio.timeout(min(timeout, handle.lease_deadline - now)):
                await self._lock.acquire()
        except TimeoutError:
            outcome = "timeout" if now + timeout <= handle.lease_deadline else "expired"
            raise TransferError(outcome, f"the staging buffer stayed busy past the deadline of "
                                         f"{handle.request_id}") from None
        try:
            yield
        finally:
            self._lock.release()

    def chunks(self, peer: Peer, remote_blocks: np.ndarray, local_blocks: np.ndarray) -> list[StagedChunk]:
        assert self.tensor is not None  # registered by the connect that made ``peer``
        src = peer.info.layout
        made = []
        for part in chunks(len(local_blocks), blocks_per_chunk(src, self.nbytes)):
            local_table, remote_table = read_tables(self.tensor.data_ptr(), self.device_id, src,
                                                    peer.info.base_addr, peer.info.device_id,
                                                    remote_blocks[part])
            made.append(StagedChunk(peer, remote_blocks[part], local_blocks[part], local_table, remote_table))
        return made

"""``DecodeAttempt``: what a decode worker keeps about one attempt at a request, in one object.

An attempt is one request id on this worker (the router's attempt there): it arrives with the
reservation (or, computed here, with the request), keeps that reservation across its prefill retries,
and ends with its last item, or an abort. The object holds the engine's ``Reservation`` (its block ids
and how many of them the prefix cache filled: where a pull writes, taken under the engine's lock when
the blocks were reserved, so a pull reads nothing of the engine), the ``decode.queue`` span, and when
the attempt's KV arrived.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.engine import Reservation
from messages.wire import GenerateRequest
from transfer.wire import KvHandle


@dataclass
class DecodeAttempt:
    request: GenerateRequest
    reservation: Reservation | None = None  # None: the prompt is computed here, in no reservation
    queue_span: Any = None  # ``decode.queue``, open from arrival to the first schedule (None: not traced)
    kv_ready: float = 0.0  # when its pull ended (``time.monotonic``); 0 while none has

    def pull_blocks(self, handle: KvHandle) -> tuple[list[int], list[int]]:
        """The prefill worker's block ids to read and this worker's to write them to: those after the
        prompt prefix this worker's cache held already."""
        assert self.reservation is not None, "a pull needs a reservation"
        held, n = self.reservation.num_cached_blocks, len(handle.block_ids)
        return handle.block_ids[held:n], self.reservation.block_ids[held:n]

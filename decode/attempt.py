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

from engine.handoff import Reservation
from engine.kv_groups import NULL_BLOCK
from messages.wire import GenerateRequest
from transfer.wire import KvHandle


@dataclass
class DecodeAttempt:
    request: GenerateRequest
    reservation: Reservation | None = None  # None: the prompt is computed here, in no reservation
    queue_span: Any = None  # ``decode.queue``, open from arrival to the first schedule (None: not traced)
    kv_ready: float = 0.0  # when its pull ended (``time.monotonic``); 0 while none has
    group_slots: tuple[int, ...] = ()  # each KV group's layer count (``engine/kv_groups.py``)

    def pull_blocks(self, handle: KvHandle) -> tuple[list[int], list[int], list[int] | None]:
        """The prefill worker's block ids to read, this worker's to write them to, and (a hybrid model)
        how many of each block's slots its KV group holds (``engine/kv_groups.py``): those after the
        prompt prefix this worker's cache held already, in every group, but the blocks a sliding group's
        window has left (on either side, -1: nothing to read there)."""
        r = self.reservation
        assert r is not None, "a pull needs a reservation"
        held = r.num_cached_blocks
        local_tables = r.tables or [r.block_ids]
        remote_tables = [handle.block_ids, *handle.group_block_ids]
        if len(remote_tables) != len(local_tables):
            raise ValueError(f"the prefill worker holds {len(remote_tables)} KV groups, this one "
                             f"{len(local_tables)}")
        if len(local_tables) == 1 and NULL_BLOCK not in local_tables[0]:
            n = len(handle.block_ids)
            return handle.block_ids[held:n], r.block_ids[held:n], None
        remote, local, slots = [], [], []
        for g, (theirs, mine) in enumerate(zip(remote_tables, local_tables, strict=True)):
            for i in range(held, min(len(theirs), len(mine))):
                if theirs[i] != NULL_BLOCK and mine[i] != NULL_BLOCK:
                    remote.append(theirs[i])
                    local.append(mine[i])
                    slots.append(self.group_slots[g])
        return remote, local, slots

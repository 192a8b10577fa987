"""In-flight prefix dedup: which uncommitted full blocks running requests are computing.

The scheduler records, for every request it admits, the chained hashes of the
full blocks it will compute itself (``track``), and forgets them as they are
committed to the prefix cache at the end of a step, or all at once when the
request finishes or is preempted (``untrack``). A waiting request whose next
uncached blocks (at least ``min_tokens`` tokens of them) are in that record for
another request should wait a step (``should_wait``) and then take them as a
prefix hit instead of computing them again; it waits at most ``max_waits``
schedules in all, then is admitted whatever runs.
"""

from __future__ import annotations

from engine.kv_cache import PrefixHit


class InflightPrefixes:
    def __init__(self, block_size: int, min_tokens: int, max_waits: int) -> None:
        self.block_size = block_size
        self.min_tokens = min_tokens
        self.max_waits = max_waits
        # block hash -> id of the running request computing that block (not yet committed)
        self._computing: dict[int, str] = {}
        # request id -> [(block index, hash)] it computes and has not committed yet
        self._computing_of: dict[str, list[tuple[int, int]]] = {}
        self._waits: dict[str, int] = {}

    def __bool__(self) -> bool:
        """True while some request is computing a tracked block or waiting for one."""
        return bool(self._computing or self._computing_of or self._waits)

    def should_wait(self, request_id: str, prefix: PrefixHit) -> bool:
        """True when ``request_id`` should wait a step for blocks another request is computing;
        counts the wait against its bound."""
        n = 0
        for h in prefix.uncached_hashes:
            owner = self._computing.get(h)
            if owner is None or owner == request_id:
                break
            n += 1
        if n == 0 or n * self.block_size < self.min_tokens:
            return False
        waits = self._waits.get(request_id, 0)
        if waits >= self.max_waits:
            return False
        self._waits[request_id] = waits + 1
        return True

    def track(self, request_id: str, prefix: PrefixHit) -> None:
        """An admitted request computes the full blocks after ``prefix`` (the first one computing a
        hash owns it)."""
        self._waits.pop(request_id, None)
        first = len(prefix.block_ids)
        mine = [(first + k, h) for k, h in enumerate(prefix.uncached_hashes)
                if self._computing.setdefault(h, request_id) == request_id]
        if mine:
            self._computing_of[request_id] = mine

    def untrack(self, request_id: str, committed_blocks: int | None = None) -> None:
        """Forget blocks ``request_id`` has committed; with ``committed_blocks`` None, everything
        about it (it finished, was aborted or was preempted)."""
        if committed_blocks is None:
            self._waits.pop(request_id, None)
        entries = self._computing_of.get(request_id)
        if entries is None:
            return
        keep = [] if committed_blocks is None else [(i, h) for i, h in entries if i >= committed_blocks]
        for i, h in entries:
            if (committed_blocks is None or i < committed_blocks) and self._computing.get(h) == request_id:
                del self._computing[h]
        if keep:
            self._computing_of[request_id] = keep
        else:
            del self._computing_of[request_id]

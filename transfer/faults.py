"""Injected read failures, for tests and chaos runs only (off unless asked for).

``fail_next(n)`` fails the next ``n`` reads; ``fail_at_rate(rate, seed)`` fails each read with
probability ``rate`` drawn from ``random.Random(seed)`` (the same seed fails the same reads). ``check``
is called once per read before anything is posted, exactly where a refused READ would fail, and raises
``TransferError("injected")``.
"""

from __future__ import annotations

import random

from transfer.errors import TransferError


class FaultInjector:
    """Decides, read by read, whether to fail it; see the module docstring."""

    def __init__(self) -> None:
        self._failures = 0
        self._rate = 0.0
        self._rng = random.Random(0)

    def fail_next(self, n: int) -> None:
        self._failures = n

    def fail_at_rate(self, rate: float, seed: int = 0) -> None:
        """Fail each later read with probability ``rate`` (0 turns it off), drawn from ``Random(seed)``."""
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"failure rate must be within [0, 1], got {rate}")
        self._rate = rate
        self._rng = random.Random(seed)

    def check(self, request_id: str) -> None:
        """Raise ``TransferError("injected")`` when this read is one to fail."""
        if self._failures > 0:
            self._failures -= 1
            raise TransferError("injected", f"injected failure reading {request_id}")
        if self._rate > 0.0 and self._rng.random() < self._rate:
            raise TransferError("injected", f"injected failure (rate {self._rate:g}) reading {request_id}")

"""Waiting on a condition, never on a sleep: poll it until it holds, and fail with what was awaited (and
what was last seen) once a deadline passes. The deadline bounds a hang; it is never what a test measures.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(probe: Callable[[], T | None], timeout: float, what: str, interval: float = 0.05,
               detail: Callable[[], object] | None = None) -> T:
    """Call ``probe`` every ``interval`` seconds until it answers something true, and return that; an
    ``AssertionError`` naming ``what`` and the last answer (or ``detail()``) after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        seen = probe()
        if seen:
            return seen
        if time.monotonic() > deadline:
            shown = detail() if detail is not None else seen
            raise AssertionError(f"{what}: not within {timeout} s (last seen: {shown!r})")
        time.sleep(interval)


async def until(probe: Callable[[], Awaitable[T | None]], timeout: float, what: str,
                interval: float = 0.0) -> T:
    """``wait_until`` on the event loop: await ``probe()`` each ``interval`` seconds (0: each turn of the
    loop) until it answers something true."""
    deadline = time.monotonic() + timeout
    while True:
        seen = await probe()
        if seen:
            return seen
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout} s (last seen: {seen!r})")
        await asyncio.sleep(interval)

"""Stand-ins for the parts a unit test cannot run here: Ray actor handles and the clock.

- ``FakeActor(**replies)``: a Ray actor handle without Ray. ``actor.method.remote(*args)`` records the
  method's name in ``actor.calls`` and returns an awaitable of ``replies["method"]`` (raised when it is an
  exception); a method with no reply fails the call with ``KeyError``, so a test notices a call it did
  not expect. A reply that is an async iterator (``SilentStream``) is returned as it is, for streaming
  methods (``actor.outputs.options(num_returns="streaming").remote(channel)``).
- ``SilentStream``: a streaming call that never yields, as a decode worker's output stream while it is
  busy.
- ``FakeClock``: a clock that moves only when the test says (``advance``); pass it where the code under
  test takes a ``clock`` (``time.monotonic`` or ``time.time`` by default), and ``clock.sleep`` where it
  takes a ``sleep``: a sleep advances the clock at once and runs the test's ``on_sleep`` hook, so a
  retry loop runs in the test's thread, step by step.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any


class SilentStream:
    """A streaming actor call that never yields."""

    def __aiter__(self) -> SilentStream:
        return self

    async def __anext__(self) -> object:
        await asyncio.Event().wait()
        raise StopAsyncIteration


class _Method:
    def __init__(self, actor: FakeActor, name: str) -> None:
        self._actor = actor
        self._name = name

    def options(self, **_: object) -> _Method:
        return self

    def remote(self, *_: object) -> Any:
        self._actor.calls.append(self._name)
        value = self._actor.replies[self._name]
        if hasattr(value, "__anext__"):
            return value
        return self._reply(value)

    @staticmethod
    async def _reply(value: object) -> object:
        if isinstance(value, BaseException):
            raise value
        return value


class FakeActor:
    """A Ray actor handle whose calls answer ``replies``; see the module docstring."""

    def __init__(self, **replies: object) -> None:
        self.replies = replies
        self.calls: list[str] = []

    def __getattr__(self, name: str) -> _Method:
        if name.startswith("_"):
            raise AttributeError(name)
        return _Method(self, name)


class FakeClock:
    """Seconds that move only by ``advance`` (or a ``sleep``); callable like ``time.monotonic``."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start
        self.sleeps: list[float] = []
        self.on_sleep: Callable[[], None] = lambda: None

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds

    def sleep(self, seconds: float) -> None:
        """What a ``sleep`` argument gets: the clock moves by ``seconds``, then ``on_sleep`` runs."""
        self.sleeps.append(seconds)
        self.advance(seconds)
        self.on_sleep()


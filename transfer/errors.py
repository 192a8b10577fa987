"""Errors raised by the KV transfer layer."""

from __future__ import annotations


class TransferError(RuntimeError):
    """A KV read that did not complete.

    ``outcome`` is a short, bounded label for spans and metrics: ``"timeout"`` (the
    caller's deadline passed), ``"expired"`` (the source's lease deadline passed, so the
    source may already have freed the blocks), ``"error"`` (NIXL reported an error),
    ``"injected"`` (a fault injected by :meth:`KvSink.inject_failures` or ``inject_failure_rate``) or
    ``"unknown_agent"`` (the handle names an agent the sink never connected to).
    """

    def __init__(self, outcome: str, message: str) -> None:
        super().__init__(f"{outcome}: {message}")
        self.outcome = outcome


class IncompatibleKvError(ValueError):
    """Two peers whose KV caches cannot exchange blocks; ``field`` names what differs."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field

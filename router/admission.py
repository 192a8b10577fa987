"""Admission control: bound the work waiting in the cluster, answer 503 + Retry-After beyond it.

A request is *queued* from admission until its first token arrives (prefill
finished): that is the backlog that grows when the cluster falls behind and the
one clients should be turned away from. ``max_queued_requests`` bounds HTTP
requests (a request with ``n`` choices counts once); ``max_queued_tokens``
bounds their prompt tokens (``n`` x prompt length, since each choice is
prefilled). A request larger than ``max_queued_tokens`` on its own is still
admitted when nothing else is queued, so no request is refused forever.

A request is *in flight* from admission until its response is complete. Every
``Ticket`` is released exactly once (``release`` is idempotent), on completion,
error or client disconnect, so the counters return to zero when idle.
"""

from __future__ import annotations

from dataclasses import dataclass

from router.errors import unavailable


@dataclass
class Ticket:
    """One admitted request's share of the limits."""

    gate: AdmissionGate
    tokens: int
    queued: bool = True
    released: bool = False

    def started(self) -> None:
        """The first token arrived: the request leaves the queue (it stays in flight)."""
        if self.queued and not self.released:
            self.queued = False
            self.gate.queued_requests -= 1
            self.gate.queued_tokens -= self.tokens

    def release(self) -> None:
        """The response is complete (or failed, or the client left); idempotent."""
        if self.released:
            return
        self.started()
        self.released = True
        self.gate.in_flight -= 1

    def __enter__(self) -> Ticket:
        return self

    def __exit__(self, *_: object) -> None:
        self.release()


@dataclass
class AdmissionGate:
    max_queued_requests: int
    max_queued_tokens: int | None = None
    queued_requests: int = 0
    queued_tokens: int = 0
    in_flight: int = 0

    def admit(self, tokens: int) -> Ticket:
        """Reserve room for a request of ``tokens`` prompt tokens; raises a 503 APIError when full."""
        if self.queued_requests >= self.max_queued_requests:
            raise unavailable(f"Too many queued requests ({self.queued_requests}); retry later.",
                              code="queue_full")
        limit = self.max_queued_tokens
        if limit is not None and self.queued_requests and self.queued_tokens + tokens > limit:
            raise unavailable(f"Too many queued prompt tokens ({self.queued_tokens} + {tokens} > {limit}); "
                              "retry later.", code="queue_full")
        self.queued_requests += 1
        self.queued_tokens += tokens
        self.in_flight += 1
        return Ticket(self, tokens)

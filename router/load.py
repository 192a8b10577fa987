"""Load accounting: which worker the router sent what, until the request is done with it.

``Chooser.pick`` asks the routing policy for a worker of a role and charges it
the work it takes on: the prompt tokens it lacks (to compute on prefill, to
receive or compute on decode) plus, on decode, the tokens it will generate;
the prompt's block hashes count as pending there (see ``router.worker_table``)
from that moment. ``Chooser.release`` uncharges it; the pending prefix stays
until the worker's KV events show it (``ok``: the worker computed or received
it) or goes at once (it failed). Every pick is counted in ``decisions`` by
``(role, policy, reason)`` for ``/metrics``.
"""

from __future__ import annotations

from dataclasses import dataclass

from messages.wire import GenerateRequest
from router.policy import RoutingPolicy
from router.worker_table import WorkerState, WorkerTable


@dataclass(frozen=True)
class Choice:
    """A picked worker and the leading prompt tokens the router believes it holds (or will)."""

    worker: WorkerState
    prefix_tokens: int


class Chooser:
    def __init__(self, table: WorkerTable, policy: RoutingPolicy, pending_ttl: float,
                 settle_ttl: float) -> None:
        self.table = table
        self.policy = policy
        self.pending_ttl = pending_ttl
        self.settle_ttl = settle_ttl
        self.block_size = 16
        self.decisions: dict[tuple[str, str, str], int] = {}
        self._charges: dict[tuple[int, str], int] = {}

    def pick(self, role: str, live: list[WorkerState], req: GenerateRequest) -> Choice:
        n = len(req.prompt_token_ids)
        index = self.table.index
        hashes = index.hashes(req.prompt_token_ids) if index else []
        cands = self.table.candidates(live, hashes, self.block_size, n)
        need = -(-(n + 1) // self.block_size)
        chosen, reason = self.policy.pick(role, cands, n, need)
        self.count(role, reason)
        worker = live[chosen.index]
        output = (req.sampling.max_tokens or 0) if role == "decode" else 0
        charge = max(n - chosen.prefix_tokens, 0) + output
        worker.inflight_tokens += charge
        worker.add_pending(req.request_id, hashes, self.pending_ttl)
        self._charges[(id(worker), req.request_id)] = charge
        self.table.poke()
        return Choice(worker, chosen.prefix_tokens)

    def release(self, worker: WorkerState, request_id: str, ok: bool) -> None:
        """The request is done with ``worker`` (idempotent)."""
        charge = self._charges.pop((id(worker), request_id), 0)
        worker.inflight_tokens = max(0, worker.inflight_tokens - charge)
        worker.settle(request_id, ok, self.settle_ttl)

    def in_flight(self, worker: WorkerState) -> int:
        """Requests charged to ``worker`` and not yet released: what it still serves for this router."""
        key = id(worker)
        return sum(1 for w, _ in self._charges if w == key)

    def count(self, role: str, reason: str) -> None:
        key = (role, self.policy.name, reason)
        self.decisions[key] = self.decisions.get(key, 0) + 1

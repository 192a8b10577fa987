"""The disaggregated handoff's half of ``LLMEngine`` (``KvHandoff``, a base the engine inherits).

A prefill engine runs a request with ``hold_kv`` and, once it finishes, hands over what it holds
(``held_kv``: every KV group's table, the tokens a compressed sequence dropped, its blocks' attention mass)
until ``release_kv``. A decode engine ``reserve``s blocks for the prompt and first token before any K/V
arrives, reusing its own cached prefix (at most ``compressed_bound`` tokens under ``--kv-window`` or
``--kv-eviction``, fitted to the kept blocks by ``compress_reservation``), then ``start_prefilled`` runs
the request from the first token on once a transfer has filled them; ``start_local`` recomputes the
prompt here instead, ``cancel_reservation`` gives the blocks back.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.config import EngineConfig
from engine.kv_cache import KVCacheManager
from engine.kv_eviction import KvEviction
from engine.outputs import RequestOutput
from engine.request import Request
from engine.sampling import TokenLogprobs
from engine.scheduler import KvWindow, Scheduler


@dataclass(frozen=True)
class Reservation:
    """Blocks a decode engine holds for a prompt; the first ``num_cached_blocks`` are already filled.

    ``block_ids`` is KV group 0's table; ``tables`` every group's (``engine/kv_groups.py``), a sliding
    group's blocks outside the window of the first decode step ``NULL_BLOCK``: nothing to fill there.
    """

    request_id: str
    block_ids: list[int]
    num_cached_blocks: int
    tables: list[list[int]] = field(default_factory=list)
    dropped_tokens: int = 0  # fitted to a compressed sequence that lost this many (``compress_reservation``)


@dataclass
class HeldKv:
    """A finished ``hold_kv`` request's KV, for its handoff (``LLMEngine.held_kv``): every group's table,
    the tokens of the blocks it dropped (a compressed sequence), each group-0 block's attention mass
    (``--kv-eviction``: its ``layers x kv_heads`` masses, block after block; empty otherwise)."""

    tables: list[list[int]]
    dropped_tokens: int = 0
    block_mass: list[float] = field(default_factory=list)


class KvHandoff:
    """The handoff's methods over the engine's state (the attributes below, which ``LLMEngine`` sets)."""

    config: EngineConfig
    kv: KVCacheManager
    kv_window: KvWindow | None
    eviction: KvEviction | None
    scheduler: Scheduler
    requests: dict[str, Request]
    reserved: dict[str, Request]
    max_model_len: int

    def _output(self, request: Request, new_token_ids: list[int]) -> RequestOutput:
        raise NotImplementedError  # LLMEngine's

    def release_kv(self, request_id: str) -> int:
        """Free blocks kept by a finished ``hold_kv`` request; idempotent."""
        return self.kv.free(request_id)

    def reserve(self, request: Request) -> Reservation | None:
        """Hold blocks for ``request``'s prompt and first token; None when the pool has no room.

        With ``--kv-window`` or ``--kv-eviction`` a prompt longer than a compressed sequence can hold
        (``compressed_bound``) arrives compressed: only that many tokens are held, and no prefix hit
        (the kept blocks are not the prompt's leading ones). ``compress_reservation`` fits the
        reservation to what the prefill worker actually kept."""
        n = len(request.prompt_token_ids)
        bound = self.compressed_bound()
        if bound is not None and n > bound:
            if not self.kv.allocate(request.request_id, bound + 1):
                return None
            self.reserved[request.request_id] = request
            tables = self.kv.tables_of(request.request_id)
            return Reservation(request.request_id, tables[0], 0, tables)
        hit = self.kv.find_prefix(request.prompt_token_ids, n)
        if not self.kv.allocate(request.request_id, n + 1, hit):
            return None
        # a sliding group holds (and a transfer fills) only the blocks the first decode step reads
        self.kv.release_outside_window(request.request_id, n)
        self.reserved[request.request_id] = request
        request.metrics.cached_prompt_tokens = hit.num_tokens(self.kv.block_size)
        tables = self.kv.tables_of(request.request_id)
        return Reservation(request.request_id, tables[0], hit.num_blocks, tables)

    def compressed_bound(self) -> int | None:
        """The most tokens a sequence holds once its prompt is computed, with ``--kv-window`` (sinks, the
        window and a block, plus the last chunk) or ``--kv-eviction`` (its budget, or its recent
        window and a block when that is larger); None without either."""
        bs = self.kv.block_size
        if self.kv_window is not None:
            w = self.kv_window
            return w.sink_blocks * bs + w.window + bs + self.config.max_num_batched_tokens
        if self.eviction is not None:
            return max(self.eviction.budget, self.eviction.recent + bs)
        return None

    def compress_reservation(self, request_id: str, kept_tokens: int,
                             dropped_tokens: int) -> Reservation | None:
        """Fit a reservation to a compressed sequence handed over (``KvHandle.dropped_tokens``): fresh
        blocks for its ``kept_tokens`` and first token, none of them cached; None when they do not fit
        (the reservation is then gone)."""
        request = self.reserved[request_id]
        if not self.kv.compressed(request_id, kept_tokens + 1, dropped_tokens):
            del self.reserved[request_id]
            return None
        request.metrics.cached_prompt_tokens = 0
        tables = self.kv.tables_of(request_id)
        return Reservation(request_id, tables[0], 0, tables, dropped_tokens)

    def held_kv(self, request_id: str) -> HeldKv:
        """What a finished ``hold_kv`` request holds, for its handoff: every KV group's table, the tokens
        its dropped blocks held, and (``--kv-eviction``) group 0's blocks' attention mass, each block's
        ``layers x kv_heads`` masses in table order."""
        tables = self.kv.tables_of(request_id)
        mass: list[float] = []
        if self.eviction is not None and tables[0]:
            mass = self.eviction.mass[torch.tensor(tables[0], dtype=torch.int64)].flatten().tolist()
        return HeldKv(tables, self.kv.dropped_tokens(request_id), mass)

    def cancel_reservation(self, request_id: str) -> None:
        self.reserved.pop(request_id, None)
        self.kv.free(request_id)

    def start_prefilled(self, request_id: str, first_token: int, logprobs: TokenLogprobs | None = None,
                        cached_prompt_tokens: int = 0,
                        block_mass: list[float] | None = None) -> RequestOutput:
        """Run a reserved request whose prompt K/V now fills its blocks, from its first token on; a
        compressed one (``compress_reservation``) goes on with its kept blocks and, under
        ``--kv-eviction``, the attention mass they had gathered on the prefill worker (``HeldKv.block_mass``:
        a row of ``layers x kv_heads`` masses per block)."""
        request = self.reserved.pop(request_id)
        n = len(request.prompt_token_ids)
        request.num_computed_tokens = n
        request.kv_dropped_tokens = self.kv.dropped_tokens(request_id)
        if self.eviction is not None:
            request.metrics.kv_evicted_tokens = request.kv_dropped_tokens
            if block_mass:
                width = self.eviction.mass.shape[1]
                if len(block_mass) % width:
                    raise ValueError(f"block_mass of {len(block_mass)} values: not rows of {width}")
                rows = torch.tensor(block_mass, dtype=torch.float32, device=self.eviction.mass.device)
                table = self.kv.blocks_of(request_id)[: len(block_mass) // width]
                blocks = torch.tensor(table, dtype=torch.int64)
                self.eviction.mass[blocks] = rows.view(-1, width)[: len(table)]
        request.metrics.cached_prompt_tokens = max(request.metrics.cached_prompt_tokens, cached_prompt_tokens)
        self.kv.cache_blocks(request_id, request.prompt_token_ids, n)
        request.append_token(first_token, logprobs, self.max_model_len)
        if request.is_finished:
            self.kv.free(request_id)
        else:
            self.scheduler.add_running(request)
            self.requests[request_id] = request
        return self._output(request, [first_token])

    def start_local(self, request_id: str) -> None:
        """Run a reserved request's prompt here instead (recompute); its cached prefix still counts."""
        request = self.reserved.pop(request_id)
        self.kv.free(request_id)
        self.scheduler.add(request)
        self.requests[request_id] = request

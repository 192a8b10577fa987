"""The scheduler: who runs this step and with how many tokens.

One unified rule (no separate prefill and decode phases): every request has
``num_computed_tokens`` and wants to reach ``num_tokens``. Each step spends a
token budget (``max_num_batched_tokens``) over running requests first (a decode
costs one token; an unfinished prefill continues with its next chunk), then over
waiting requests in queue order (priority, then arrival), which begin with any
prefix-cache hit. Running requests are never starved by new ones. A decoding request may add
proposed tokens to verify (speculative decoding, ``engine/spec_decode.py``); they count against
the budget and the pool like any other token.

Priorities follow vLLM: a *lower* ``priority`` value is more important (default
0). The waiting queue is ordered by priority, then arrival.

When the pool cannot hold a running request's next tokens, the scheduler
preempts the least important running request (highest ``priority`` value,
latest arrival): it frees its blocks and goes back to the waiting queue, ahead of
waiting requests of the same or lower importance, keeping the tokens it has
generated. With ``preemption_mode="recompute"`` its K/V are recomputed when it
resumes; with ``"swap"`` (and a ``swapper``, see ``engine/swap.py``) its computed
blocks are copied to host memory first and copied back into fresh blocks when
it resumes, so nothing is recomputed (recompute is the fallback when the swap
space is full).

Bounded KV (attention sinks + sliding window, ``KvWindow``): before a running
request's next chunk, every whole block after the first ``sink_blocks`` whose
tokens are all more than ``window`` tokens behind the next token is freed
(``request.kv_dropped_tokens`` counts them). The model still gets absolute
positions; attention sees the sink blocks, then the kept blocks, so a token
attends to the sinks and to between ``window`` and ``window + block_size - 1``
previous tokens. A request's KV stays bounded however long it generates.

Attention-aware eviction (``--kv-eviction h2o|headwise``, ``engine/kv_eviction.py``): before a
request's chunk, its least-attended blocks outside its recent window (by the policy's score) are freed
until the chunk fits its budget, and the chunk is cut to what the budget leaves.

In-flight prefix dedup (``engine/prefix_wait.py``): a waiting request whose next uncached full blocks (at
least ``prefix_wait_min_tokens`` tokens of them, by chained hash; 0 turns this
off) are being computed right now by a running request is skipped (the
requests behind it are still admitted) until those blocks are committed to the
prefix cache at the end of the step that computes them; it is then admitted
with them as a prefix hit instead of computing them a second time. A request
is skipped this way in at most ``max_prefix_wait_steps`` schedules (default:
twice the chunks a longest prompt takes, plus 2), then is admitted whatever
runs. Off with a sliding window or eviction (their blocks stop being published) and without
caching.

The scheduler sees the KV manager through ``allocate``/``free``/``find_prefix``
only; the engine sees ``SchedulerOutput``.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

from engine.kv_cache import KVCacheManager
from engine.kv_eviction import KvEviction
from engine.prefix_wait import InflightPrefixes
from engine.request import Request, RequestStatus
from engine.swap import HostSwapSpace

PREEMPTION_MODES = ("recompute", "swap")


@dataclass(frozen=True)
class KvWindow:
    """Keep the first ``sink_blocks`` blocks and the last ``window`` tokens (in whole blocks)."""

    sink_blocks: int
    window: int


@dataclass
class ScheduledRequest:
    """A request's chunk this step: ``num_new_tokens`` tokens from ``num_computed_tokens`` on, the
    last ``len(spec_token_ids)`` of them proposed tokens to verify (``engine/spec_decode.py``)."""

    request: Request
    num_new_tokens: int
    spec_token_ids: list[int] = field(default_factory=list)

    @property
    def completes(self) -> bool:
        """True when this chunk reaches the end of the known tokens (a token will be sampled)."""
        known = self.num_new_tokens - len(self.spec_token_ids)
        return self.request.num_computed_tokens + known == self.request.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    def __bool__(self) -> bool:
        return bool(self.scheduled)


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        max_model_len: int,
        preemption_mode: str = "recompute",
        swapper: HostSwapSpace | None = None,
        kv_window: KvWindow | None = None,
        prefix_wait_min_tokens: int = 128,
        max_prefix_wait_steps: int | None = None,
        eviction: KvEviction | None = None,
    ) -> None:
        self.kv_window = kv_window
        self.eviction = eviction  # --kv-eviction (engine/kv_eviction.py)
        if preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"--preemption-mode must be recompute or swap, got {preemption_mode!r}")
        if preemption_mode == "swap" and swapper is None:
            raise ValueError("swap preemption needs a swap space")
        self.preemption_mode = preemption_mode
        self.swapper = swapper
        self.kv = kv
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        if max_prefix_wait_steps is None:
            max_prefix_wait_steps = 2 * -(-max_model_len // max(1, max_num_batched_tokens)) + 2
        self.inflight = (InflightPrefixes(kv.block_size, prefix_wait_min_tokens, max_prefix_wait_steps)
                         if kv_window is None and eviction is None and prefix_wait_min_tokens > 0 else None)
        self.num_prefix_waits = 0  # schedules in which some request waited for an in-flight prefix

    def add(self, request: Request) -> None:
        max_blocks_tokens = self.kv.num_blocks * self.kv.block_size
        if request.num_tokens > min(self.max_model_len, max_blocks_tokens):
            raise ValueError(
                f"prompt of {request.num_tokens} tokens exceeds the limit of "
                f"{min(self.max_model_len, max_blocks_tokens)} tokens"
            )
        self._enqueue(request)

    def _enqueue(self, request: Request, front: bool = False) -> None:
        request.status = RequestStatus.WAITING
        for i, other in enumerate(self.waiting):
            if request.priority < other.priority or (front and request.priority == other.priority):
                self.waiting.insert(i, request)
                return
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def num_waiting(self) -> int:
        return len(self.waiting)

    def schedule(self, drafts: Mapping[str, list[int]] | None = None) -> SchedulerOutput:
        """This step's chunks. ``drafts`` (request id -> proposed tokens) adds a decoding request's
        proposals to its chunk when the budget and the pool have room for them all; otherwise they are
        dropped before anything is preempted for them."""
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        for request in list(self.running):
            if budget <= 0:
                break
            if request not in self.running:
                continue
            n = min(request.num_tokens - request.num_computed_tokens, budget)
            if n <= 0:
                continue
            self._slide(request)
            if self.eviction is not None:
                n = self.eviction.fit(self.kv, request, n)
            draft = drafts.get(request.request_id) if drafts and n == 1 else None
            if draft and budget > 1:
                draft = draft[: budget - 1]
                if self.kv.allocate(request.request_id, request.kv_tokens + 1 + len(draft)):
                    out.scheduled.append(ScheduledRequest(request, 1 + len(draft), list(draft)))
                    budget -= 1 + len(draft)
                    continue
            while not self.kv.allocate(request.request_id, request.kv_tokens + n):
                if self._drop_proposals(out):
                    continue
                victim = self._preemption_victim()
                self._preempt(victim, out)
                if victim is request:
                    break
            else:
                out.scheduled.append(ScheduledRequest(request, n))
                budget -= n

        i = 0
        waited = False
        while i < len(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs:
            if out.preempted:
                break
            request = self.waiting[i]
            if self.swapper is not None and self.swapper.holds(request.request_id):
                if not self._resume_swapped(request, budget, out):
                    break
                budget -= out.scheduled[-1].num_new_tokens
                continue
            prefix = self.kv.find_prefix(request.all_token_ids, request.num_tokens - 1, record=False)
            if self.inflight is not None and self.inflight.should_wait(request.request_id, prefix):
                waited = True
                i += 1
                continue
            num_cached = prefix.num_tokens(self.kv.block_size)
            n = min(request.num_tokens - num_cached, budget)
            if self.eviction is not None:  # the first chunk within the sequence's KV budget
                n = max(1, min(n, self.eviction.budget - num_cached))
            if not self.kv.allocate(request.request_id, num_cached + n, prefix):
                break
            self.kv.record_prefix(request.num_tokens, num_cached)
            del self.waiting[i]
            if self.inflight is not None:
                self.inflight.track(request.request_id, prefix)
            request.num_computed_tokens = num_cached
            if request.metrics.first_scheduled_time is None:
                request.metrics.first_scheduled_time = time.monotonic()
                request.metrics.cached_prompt_tokens = min(num_cached, len(request.prompt_token_ids))
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.scheduled.append(ScheduledRequest(request, n))
            budget -= n
        self.num_prefix_waits += waited
        return out

    def _drop_proposals(self, out: SchedulerOutput) -> bool:
        """Take back the proposed tokens of the last chunk that has some, and their blocks; False if
        none has (only then may a request be preempted)."""
        for item in reversed(out.scheduled):
            if item.spec_token_ids:
                item.num_new_tokens -= len(item.spec_token_ids)
                item.spec_token_ids = []
                self.kv.shrink(item.request.request_id, item.request.kv_tokens + item.num_new_tokens)
                return True
        return False

    def _slide(self, request: Request) -> None:
        """Free the blocks the window has passed (see the module docstring)."""
        if self.kv_window is None:
            return
        bs = self.kv.block_size
        sink_tokens = self.kv_window.sink_blocks * bs
        window = self.kv_window.window
        while request.num_computed_tokens - (sink_tokens + request.kv_dropped_tokens + bs) >= window:
            self.kv.drop_block(request.request_id, self.kv_window.sink_blocks)
            request.kv_dropped_tokens += bs

    def _resume_swapped(self, request: Request, budget: int, out: SchedulerOutput) -> bool:
        """Give a swapped-out request fresh blocks and copy its K/V back; False if they do not fit."""
        assert self.swapper is not None
        n = min(request.num_tokens - request.num_computed_tokens, budget)
        if not self.kv.allocate(request.request_id, request.kv_tokens + n):
            return False
        self.swapper.swap_in(request.request_id, self.kv.blocks_of(request.request_id))
        self.waiting.remove(request)
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        out.scheduled.append(ScheduledRequest(request, n))
        return True

    def _preemption_victim(self) -> Request:
        return max(self.running, key=lambda r: (r.priority, r.metrics.arrival_time))

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        self.running.remove(request)
        if self.inflight is not None:
            self.inflight.untrack(request.request_id)
        swapped = False
        if self.preemption_mode == "swap" and self.swapper is not None and request.num_computed_tokens > 0:
            used = self.kv.blocks_needed(request.kv_tokens)
            blocks = self.kv.blocks_of(request.request_id)[:used]
            swapped = self.swapper.swap_out(request.request_id, blocks)
        self.kv.free(request.request_id)
        if not swapped:
            request.num_computed_tokens = 0
            request.kv_dropped_tokens = 0
        request.metrics.num_preemptions += 1
        self.num_preemptions += 1
        out.scheduled = [s for s in out.scheduled if s.request is not request]
        out.preempted.append(request)
        self._enqueue(request, front=True)

    def update_after_step(self, out: SchedulerOutput) -> None:
        """Advance computed-token counts and publish newly full blocks to the prefix cache."""
        for item in out.scheduled:
            request = item.request
            request.num_computed_tokens += item.num_new_tokens
            self.kv.cache_blocks(request.request_id, request.all_token_ids, request.num_computed_tokens)
            self.kv.release_outside_window(request.request_id, request.num_computed_tokens)
            if self.inflight is not None:
                self.inflight.untrack(request.request_id, request.num_computed_tokens // self.kv.block_size)

    def add_running(self, request: Request) -> None:
        """Admit a request whose prompt K/V is already in its blocks (it arrived prefilled)."""
        request.status = RequestStatus.RUNNING
        if request.metrics.first_scheduled_time is None:
            request.metrics.first_scheduled_time = time.monotonic()
        self.running.append(request)

    def finish(self, request: Request, free_kv: bool = True) -> None:
        """Drop a finished or aborted request from the queues; free its blocks unless told to keep them."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        if self.inflight is not None:
            self.inflight.untrack(request.request_id)
        if self.swapper is not None:
            self.swapper.discard(request.request_id)
        if free_kv:
            self.kv.free(request.request_id)

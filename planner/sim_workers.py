"""The simulated workers: a prefill engine's chunked steps and a decode engine's continuous batching.

Prefill (as ``engine/scheduler.py`` runs it on a prefill worker): a FIFO queue; each step spends
``max_num_batched_tokens`` over the queue in order, an unfinished prompt continuing with its next chunk
first. A prompt's first chunk starts after its prefix-cache hit (whole blocks of its prefix, at most
``input - 1`` tokens, when the worker's cache holds the prefix). The step takes
``PrefillCost.step_s`` of the chunks; a prompt whose last chunk ran leaves with its first token.

Decode (``decode/worker.py``): a request whose KV arrived joins at the next step boundary (at once if
the worker is idle); its first token reaches the client then. Every step gives each running request a
token; it takes ``DecodeCost.step_s(batch, context)``. Steps are not simulated one by one: between two
changes of the batch (a join or a finish) the step times form an arithmetic series (the context grows
by ``batch`` tokens a step), so a worker advances a whole *segment* of steps in one event, cut short
when a request arrives mid-segment (it joins at the end of the step then running). A worker's events
are therefore a few per request, however many tokens it generates. A request is admitted while the
worker has fewer than ``max_num_seqs`` running and KV room for its whole prompt and output; otherwise
it waits (first token already sent) until a finish frees room.

Prefix caches are LRU sets of prefix ids with a token capacity: a prefill worker's whole KV capacity
(its blocks are free once pulled, and stay cached), half a decode worker's (running requests hold the
rest).
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from planner.profile import DecodeCost, PrefillCost


class Req:
    """A request in flight; times in simulated seconds (NaN until they happen)."""

    __slots__ = ("arrival", "n_in", "n_out", "prefix", "prefix_tokens", "client", "prefill", "decode",
                 "computed", "cached", "first", "end", "p_charge", "d_charge", "need")

    def __init__(self, arrival: float, n_in: int, n_out: int, prefix: int, prefix_tokens: int,
                 client: int = -1) -> None:
        self.arrival = arrival
        self.n_in = n_in
        self.n_out = n_out
        self.prefix = prefix
        self.prefix_tokens = prefix_tokens
        self.client = client
        self.prefill: PrefillSim | None = None
        self.decode: DecodeSim | None = None
        self.computed = -1  # prompt tokens in the prefill worker's KV; -1: not scheduled yet
        self.cached = 0
        self.first = math.nan
        self.end = math.nan
        self.p_charge = 0
        self.d_charge = 0
        self.need = n_in + n_out

    def hit_tokens(self, block_size: int) -> int:
        """The leading tokens a cache holding this request's prefix serves (whole blocks, < input)."""
        if self.prefix < 0:
            return 0
        return min(self.prefix_tokens, self.n_in - 1) // block_size * block_size


class PrefixLru:
    """Prefix ids a worker's KV cache holds, least recently used first, within ``capacity`` tokens."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.tokens = 0
        self.entries: OrderedDict[int, int] = OrderedDict()

    def __contains__(self, prefix: int) -> bool:
        return prefix in self.entries

    def touch(self, prefix: int) -> None:
        if prefix in self.entries:
            self.entries.move_to_end(prefix)

    def insert(self, prefix: int, tokens: int) -> list[int]:
        """Hold ``prefix``; returns the prefix ids evicted to make room."""
        if prefix < 0 or tokens <= 0:
            return []
        if prefix in self.entries:
            self.entries.move_to_end(prefix)
            return []
        self.entries[prefix] = tokens
        self.tokens += tokens
        evicted = []
        while self.tokens > self.capacity and len(self.entries) > 1:
            old, size = self.entries.popitem(last=False)
            self.tokens -= size
            evicted.append(old)
        return evicted


@dataclass(eq=False)
class PrefillSim:
    index: int
    cost: PrefillCost
    budget: int
    max_seqs: int
    cache: PrefixLru
    queue: deque[Req] = field(default_factory=deque)
    chunks: list[tuple[Req, int]] = field(default_factory=list)
    busy: bool = False
    step_t0: float = 0.0
    busy_s: float = 0.0  # wall time stepping (stretched when the host is shared)
    work_s: float = 0.0  # the same steps' costs at full speed
    cpu_s: float = 0.0  # their CPU time: the costs times the contention they ran under
    step_work: float = 0.0  # the running step's cost at full speed
    load: int = 0  # tokens the router has charged and not yet released
    load_version: int = 0
    version: int = 0  # of the step running: an end event of an older one is stale
    work_left: float = 0.0  # seconds of the running step left at full speed, as of t_update
    rate: float = 1.0  # its speed: 1 / (wait x contention)
    contention: float = 1.0  # the running step's contention since t_update
    t_update: float = 0.0

    def start_step(self, now: float, block_size: int, wait: float = 1.0,
                   contention: float = 1.0) -> float | None:
        """Schedule the next step's chunks; its end time (its cost times ``wait`` and ``contention``), or
        None when the queue is empty (idle)."""
        self.chunks = []
        if not self.queue:
            self.busy = False
            return None
        budget, new, attended = self.budget, 0, 0.0
        for r in self.queue:
            if budget <= 0 or len(self.chunks) >= self.max_seqs:
                break
            if r.computed < 0:
                hit = r.hit_tokens(block_size) if r.prefix in self.cache else 0
                self.cache.touch(r.prefix)
                r.computed = r.cached = hit
            n = min(r.n_in - r.computed, budget)
            attended += n * (r.computed + (n + 1) / 2)
            new += n
            budget -= n
            self.chunks.append((r, n))
        self.busy = True
        self.step_t0 = now
        self.work_left = self.step_work = self.cost.step_s(new, attended)
        self.rate, self.contention, self.t_update = 1.0 / (wait * contention), contention, now
        self.version += 1
        return now + self.work_left / self.rate

    def _advance(self, now: float) -> None:
        done = (now - self.t_update) * self.rate  # full-speed seconds of work done since t_update
        self.work_left = max(0.0, self.work_left - done)
        self.cpu_s += done * self.contention
        self.t_update = now

    def rescale(self, now: float, wait: float, contention: float) -> float:
        """The running step's host share changed at ``now``: its new end time (a new ``version``)."""
        self._advance(now)
        self.rate, self.contention = 1.0 / (wait * contention), contention
        self.version += 1
        return now + self.work_left / self.rate

    def end_step(self, now: float) -> list[Req]:
        """Advance the chunks; the requests whose prompt is done (they leave the queue)."""
        self._advance(now)
        self.busy_s += now - self.step_t0
        self.work_s += self.step_work
        done = []
        for r, n in self.chunks:
            r.computed += n
            if r.computed >= r.n_in:
                done.append(r)
        for r in done:
            if self.queue and self.queue[0] is r:
                self.queue.popleft()
            else:
                self.queue.remove(r)
        return done


@dataclass(eq=False)
class DecodeSim:
    index: int
    cost: DecodeCost
    max_seqs: int
    kv_tokens: int
    cache: PrefixLru
    batch: int = 0
    context: int = 0
    used: int = 0
    step: int = 0  # index of the next step to start
    finishing: list[tuple[int, int, Req]] = field(default_factory=list)  # heap of (last step, seq, req)
    joining: list[Req] = field(default_factory=list)
    waiting: deque[Req] = field(default_factory=deque)
    busy: bool = False
    version: int = 0
    seg_t0: float = 0.0
    seg_a: float = 0.0  # the segment's first step time
    seg_inc: float = 0.0  # how much each later step adds
    seg_n: int = 0  # steps the segment runs
    seg_slowdown: float = 1.0  # the host's stretch of the segment's steps (wait x contention)
    seg_contention: float = 1.0
    busy_s: float = 0.0  # wall time stepping (stretched when the host is shared)
    work_s: float = 0.0  # the same steps' costs at full speed
    cpu_s: float = 0.0  # their CPU time: the costs times the contention they ran under
    load: int = 0
    load_version: int = 0
    steps_done: int = 0

    def seg_end(self, n: int) -> float:
        """When the segment's ``n``-th step ends."""
        return self.seg_t0 + n * self.seg_a + self.seg_inc * n * (n - 1) / 2

    def steps_until(self, now: float) -> int:
        """The segment's step running at ``now`` (1-based): the least ``n`` with ``seg_end(n) >= now``."""
        dt = now - self.seg_t0
        if dt <= 0:
            return 1
        a, c = self.seg_inc / 2, self.seg_a - self.seg_inc / 2
        if a <= 0:
            n = math.ceil(dt / c) if c > 0 else 1
        else:
            n = math.ceil((-c + math.sqrt(c * c + 4 * a * dt)) / (2 * a))
        n = max(n, 1)
        while n > 1 and self.seg_end(n - 1) >= now:
            n -= 1
        while self.seg_end(n) < now:
            n += 1
        return n

    def start_segment(self, now: float, wait: float = 1.0, contention: float = 1.0) -> float | None:
        """Run steps until the next finish (each step's cost times ``wait`` and ``contention``); the
        segment's end, or None when nothing runs (idle)."""
        slowdown = wait * contention
        if self.batch == 0:
            self.busy = False
            return None
        self.busy = True
        self.version += 1
        self.seg_t0 = now
        self.seg_slowdown, self.seg_contention = slowdown, contention
        self.seg_a = self.cost.step_s(self.batch, self.context) * slowdown
        self.seg_inc = self.cost.per_context_s * self.batch * slowdown
        self.seg_n = self.finishing[0][0] - self.step + 1
        return self.seg_end(self.seg_n)

    def cut(self, now: float) -> float | None:
        """A request arrived at ``now`` mid-segment: end the segment with the step running; the new end,
        or None when it ends then already."""
        n = self.steps_until(now)
        if n >= self.seg_n:
            return None
        self.seg_n = n
        self.version += 1
        return self.seg_end(n)

    def can_admit(self, r: Req) -> bool:
        if self.batch == 0:
            return True
        return self.batch < self.max_seqs and self.used + r.need <= self.kv_tokens

    def admit(self, r: Req, seq: int) -> bool:
        """Start decoding ``r`` at the next step; False when it is done already (one output token)."""
        if r.n_out <= 1:
            return False
        self.batch += 1
        self.context += r.n_in + 1
        self.used += r.need
        heapq.heappush(self.finishing, (self.step + r.n_out - 2, seq, r))
        return True

    def end_segment(self, now: float) -> tuple[float, float, int, int, list[Req]]:
        """Close the segment: (first step time, increment, steps, batch) for the ITL record, and the
        requests that finished with its last step."""
        n, batch = self.seg_n, self.batch
        record = (self.seg_a, self.seg_inc, n, batch)
        self.busy_s += now - self.seg_t0
        self.work_s += (now - self.seg_t0) / self.seg_slowdown
        self.cpu_s += (now - self.seg_t0) / self.seg_slowdown * self.seg_contention
        self.steps_done += n
        self.step += n
        self.context += batch * n
        done = []
        while self.finishing and self.finishing[0][0] < self.step:
            r = heapq.heappop(self.finishing)[2]
            self.batch -= 1
            self.context -= r.n_in + r.n_out
            self.used -= r.need
            done.append(r)
        return record[0], record[1], record[2], record[3], done

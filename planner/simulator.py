"""A discrete-event simulation of a pdserve cluster: router, prefill and decode workers, KV transfers.

One request, as the serving code runs it (``docs/architecture.md``, "One request, hop by hop"):

1. it arrives at the router, which picks a decode and then a prefill worker with the prefix-aware
   policy at its default weights (``router/policy.py``; both take ``engine/hashing.py:prefix_cost``:
   least ``load - shared + 2 x missing`` tokens, ties to the lowest index) and charges them (prefill:
   the prompt tokens it lacks; decode: those plus the output);
2. after ``Profile.request_overhead_s`` (HTTP, router, Ray calls) it enters the prefill worker's queue
   (``planner/sim_workers.py`` for the engines);
3. when its prompt is done, the decode worker pulls the blocks it lacks (``TransferCost``; a decode
   worker that holds the prefix pulls only the rest), the prefill charge is released, and the request
   joins the decode batch at the next step boundary, where its first token reaches the client;
4. it finishes with its last decode step; the decode charge is released.

Open loop: requests arrive at their ``arrival_s``. Closed loop (``concurrency``): that many clients
each send a request when their previous one ended, until ``duration_s``. The run goes until every
request finished or ``time_limit_s`` (default: three times the last send plus 60 s) passed; requests
still unfinished count as not completed (infinite TTFT if no first token).

Workers sharing a host (CPU workers on one machine, as in the validation here), two terms:

- the wait for a core (``host_cores``): a step's wall time stretches by busy workers / cores when that is
  above 1 (``prefill_host_cores``, default ``host_cores``, for prefill steps);
- contention (``decode_contention``, ``prefill_contention``, default 1): while a worker of the other
  role computes, a step of this role needs that factor more CPU time (shared caches and memory
  bandwidth).

A step's time is its cost times both. A running prefill step is re-timed whenever another worker
starts or stops, a decode segment ends with its running step and the next steps run at the new speed.
Without either term every worker has its own device.

Not modelled: conditional disaggregation (prompts computed on a decode worker when every prefill
worker is saturated), preemption, retries and failures, the routing policy's KV-room filter, and the
CPU the router and the client use.
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np

from engine.hashing import prefix_cost
from planner.profile import Profile
from planner.results import Percentiles, SimResult
from planner.sim_workers import DecodeSim, PrefillSim, PrefixLru, Req

ARRIVE, ENQUEUE, PREFILL_END, PULLED, DECODE_END = range(5)
ITL_POINTS = 4  # points kept per decode segment for the ITL percentiles


@dataclass(frozen=True)
class RequestSpec:
    """One request: prompt and output tokens, when it is sent (open loop), and the id and length of
    the leading tokens it shares with other requests (``prefix_id`` -1: none)."""

    input_tokens: int
    output_tokens: int
    arrival_s: float = 0.0
    prefix_id: int = -1
    prefix_tokens: int = 0


@dataclass(frozen=True)
class Cluster:
    num_prefill: int
    num_decode: int

    def __post_init__(self) -> None:
        if self.num_prefill < 1 or self.num_decode < 1:
            raise ValueError(f"the simulator needs >= 1 prefill and >= 1 decode worker, got "
                             f"{self.num_prefill}P:{self.num_decode}D")


class _Role:
    """The workers of one role as the router sees them: a least-loaded heap (lazy: stale entries are
    skipped) and, per prefix id, the workers holding it (cache or a request in flight)."""

    def __init__(self, workers: list[PrefillSim] | list[DecodeSim]) -> None:
        self.workers = workers
        self.heap = [(0, w.index, 0) for w in workers]
        self.holders: dict[int, set[int]] = {}
        self.inflight: dict[tuple[int, int], int] = {}

    def charge(self, w: PrefillSim | DecodeSim, tokens: int) -> None:
        w.load += tokens
        w.load_version += 1
        heapq.heappush(self.heap, (w.load, w.index, w.load_version))

    def least_loaded(self) -> PrefillSim | DecodeSim:
        while True:
            load, index, version = self.heap[0]
            w = self.workers[index]
            if version == w.load_version:
                return w
            heapq.heappop(self.heap)

    def pick(self, r: Req, block_size: int) -> tuple[PrefillSim | DecodeSim, int]:
        """The policy's choice and the prefix tokens it holds for ``r``."""
        hit = r.hit_tokens(block_size)
        base = self.least_loaded()
        best, best_key, best_held = base, (prefix_cost(base.load, 0, r.n_in, 0), base.index), 0
        for index in self.holders.get(r.prefix, ()) if hit else ():
            w = self.workers[index]
            shared = min(hit, w.load) if self.inflight.get((index, r.prefix)) else 0
            key = (prefix_cost(w.load, shared, r.n_in, hit), index)
            if key < best_key:
                best, best_key, best_held = w, key, hit
        return best, best_held

    def hold(self, w: PrefillSim | DecodeSim, prefix: int, delta: int) -> None:
        """A request with ``prefix`` starts (+1) or ends (-1) on ``w``."""
        if prefix < 0:
            return
        key = (w.index, prefix)
        n = self.inflight.get(key, 0) + delta
        if n > 0:
            self.inflight[key] = n
            self.holders.setdefault(prefix, set()).add(w.index)
        else:
            self.inflight.pop(key, None)
            if prefix not in w.cache:
                self.holders.get(prefix, set()).discard(w.index)

    def cached(self, w: PrefillSim | DecodeSim, prefix: int, tokens: int) -> None:
        if prefix < 0:
            return
        self.holders.setdefault(prefix, set()).add(w.index)
        for old in w.cache.insert(prefix, tokens):
            if not self.inflight.get((w.index, old)):
                self.holders.get(old, set()).discard(w.index)


class Simulation:
    """One run; ``run()`` returns its ``SimResult``."""

    def __init__(self, profile: Profile, cluster: Cluster, specs: Iterable[RequestSpec], *,
                 concurrency: int | None = None, duration_s: float | None = None,
                 slo: tuple[float, float] | None = None, warmup_s: float = 0.0,
                 time_limit_s: float | None = None, host_cores: float | None = None,
                 prefill_host_cores: float | None = None, decode_contention: float = 1.0,
                 prefill_contention: float = 1.0) -> None:
        m = profile.model
        self.profile, self.cluster, self.slo, self.warmup_s = profile, cluster, slo, warmup_s
        self.bs = m.block_size
        self.prefill = [PrefillSim(i, profile.prefill, m.max_num_batched_tokens, m.max_num_seqs,
                                   PrefixLru(m.kv_capacity_tokens)) for i in range(cluster.num_prefill)]
        self.decode = [DecodeSim(i, profile.decode, m.max_num_seqs, m.kv_capacity_tokens,
                                 PrefixLru(m.kv_capacity_tokens // 2)) for i in range(cluster.num_decode)]
        self.p_role, self.d_role = _Role(self.prefill), _Role(self.decode)
        self.events: list[tuple[float, int, int, object]] = []
        self.seq = itertools.count()
        self.reqs: list[Req] = []
        self.itl: list[tuple[float, float, int, int, float]] = []
        self.specs: Iterator[RequestSpec] = iter(specs)
        self.concurrency, self.duration_s = concurrency, duration_s
        self.time_limit_s = time_limit_s
        self.last_send = 0.0
        self.n_events = 0
        self.host_cores = host_cores
        self.prefill_host_cores = host_cores if prefill_host_cores is None else prefill_host_cores
        self.decode_contention, self.prefill_contention = decode_contention, prefill_contention
        self.shared = host_cores is not None or decode_contention != 1.0 or prefill_contention != 1.0
        self.busy = 0  # workers running a step now
        self.busy_prefill = 0  # of them, prefill workers

    def _push(self, t: float, kind: int, obj: object) -> None:
        heapq.heappush(self.events, (t, next(self.seq), kind, obj))

    def _send(self, spec: RequestSpec, t: float, client: int = -1) -> None:
        r = Req(t, spec.input_tokens, spec.output_tokens, spec.prefix_id, spec.prefix_tokens, client)
        self.reqs.append(r)
        self.last_send = max(self.last_send, t)
        self._push(t, ARRIVE, r)

    def _next_for(self, client: int, t: float) -> None:
        if self.duration_s is not None and t >= self.duration_s:
            return
        spec = next(self.specs, None)
        if spec is not None:
            self._send(spec, t, client)

    def run(self) -> SimResult:
        start = time.perf_counter()
        if self.concurrency is not None:
            for c in range(self.concurrency):
                self._next_for(c, 0.0)
        else:
            for spec in self.specs:
                self._send(spec, spec.arrival_s)
        limit = self.time_limit_s if self.time_limit_s is not None else 3 * self.last_send + 60.0
        if self.concurrency is not None and self.time_limit_s is None:
            limit = 3 * (self.duration_s or 0.0) + 600.0
        now = 0.0
        handlers = (self._arrive, self._enqueue, self._prefill_end, self._pulled, self._decode_end)
        while self.events:
            now, _, kind, obj = heapq.heappop(self.events)
            if now > limit:
                break
            self.n_events += 1
            handlers[kind](now, obj)
        return self._result(time.perf_counter() - start)

    def _arrive(self, now: float, r: object) -> None:
        assert isinstance(r, Req)
        d, d_held = self.d_role.pick(r, self.bs)
        p, p_held = self.p_role.pick(r, self.bs)
        assert isinstance(d, DecodeSim) and isinstance(p, PrefillSim)
        r.decode, r.prefill = d, p
        r.d_charge, r.p_charge = r.n_in - d_held + r.n_out, r.n_in - p_held
        self.d_role.charge(d, r.d_charge)
        self.p_role.charge(p, r.p_charge)
        self.d_role.hold(d, r.prefix, +1)
        self.p_role.hold(p, r.prefix, +1)
        self._push(now + self.profile.request_overhead_s, ENQUEUE, r)

    def _enqueue(self, now: float, r: object) -> None:
        assert isinstance(r, Req) and r.prefill is not None
        p = r.prefill
        p.queue.append(r)
        if not p.busy:
            self._start_prefill(p, now)

    def _start_prefill(self, p: PrefillSim, now: float) -> None:
        delta = int(bool(p.queue)) - int(p.busy)
        self.busy += delta
        self.busy_prefill += delta
        end = p.start_step(now, self.bs, *self._share(prefill=True))
        if end is not None:
            self._push(end, PREFILL_END, (p, p.version))
        if delta:
            self._host_changed(now, p)

    def _prefill_end(self, now: float, obj: object) -> None:
        assert isinstance(obj, tuple)
        p, version = obj
        assert isinstance(p, PrefillSim)
        if version != p.version:
            return
        kv_bytes = self.profile.model.kv_bytes_per_token
        for r in p.end_step(now):
            self.p_role.cached(p, r.prefix, r.hit_tokens(self.bs))
            d = r.decode
            assert d is not None
            held = r.hit_tokens(self.bs) if r.prefix in d.cache else 0
            d.cache.touch(r.prefix)
            blocks = -(-r.n_in // self.bs) - held // self.bs
            self._push(now + self.profile.transfer.seconds(blocks * self.bs * kv_bytes), PULLED, r)
        self._start_prefill(p, now)

    def _first_token(self, r: Req, now: float) -> None:
        r.first = now
        assert r.prefill is not None and r.decode is not None
        self.p_role.charge(r.prefill, -r.p_charge)
        self.p_role.hold(r.prefill, r.prefix, -1)
        self.d_role.cached(r.decode, r.prefix, r.hit_tokens(self.bs))

    def _pulled(self, now: float, r: object) -> None:
        assert isinstance(r, Req) and r.decode is not None
        d = r.decode
        if d.busy:
            d.joining.append(r)
            end = d.cut(now)
            if end is not None:
                self._push(end, DECODE_END, (d, d.version))
            return
        self._first_token(r, now)
        self._join(d, r, now)
        self._start_decode(d, now)

    def _join(self, d: DecodeSim, r: Req, now: float) -> None:
        if d.waiting or not d.can_admit(r):
            d.waiting.append(r)
        elif not d.admit(r, next(self.seq)):
            self._finish(r, now)

    def _start_decode(self, d: DecodeSim, now: float) -> None:
        delta = int(d.batch > 0) - int(d.busy)
        self.busy += delta
        end = d.start_segment(now, *self._share())
        if end is not None:
            self._push(end, DECODE_END, (d, d.version))
        if delta:
            self._host_changed(now, d)

    def _share(self, prefill: bool = False) -> tuple[float, float]:
        """(wait, contention) of a decode step running now (``prefill``: of a prefill step): busy workers /
        cores (at least 1; 1 without ``host_cores``; the running step's worker is counted in ``busy``),
        and the role's contention while a worker of the other role is busy (else 1)."""
        cores = self.prefill_host_cores if prefill else self.host_cores
        wait = 1.0 if self.host_cores is None or cores is None else max(1.0, self.busy / cores)
        contention = self.prefill_contention if prefill else self.decode_contention
        other = self.busy - self.busy_prefill if prefill else self.busy_prefill
        return wait, (contention if other >= 1 else 1.0)

    def _host_changed(self, now: float, skip: PrefillSim | DecodeSim) -> None:
        """A worker started or stopped: re-time the other running prefill steps from now, and end the
        other decode segments with their running step (the next one starts at the new speed)."""
        if not self.shared:
            return
        wait, contention = self._share(prefill=True)
        for p in self.prefill:
            if p.busy and p is not skip:
                self._push(p.rescale(now, wait, contention), PREFILL_END, (p, p.version))
        for d in self.decode:
            if d.busy and d is not skip:
                end = d.cut(now)
                if end is not None:
                    self._push(end, DECODE_END, (d, d.version))

    def _decode_end(self, now: float, obj: object) -> None:
        assert isinstance(obj, tuple)
        d, version = obj
        assert isinstance(d, DecodeSim)
        if version != d.version:
            return
        a, inc, n, batch, done = d.end_segment(now)
        self.itl.append((a, inc, n, batch, d.seg_t0))
        for r in done:
            self._finish(r, now)
        while d.waiting and d.can_admit(d.waiting[0]):
            r = d.waiting.popleft()
            if not d.admit(r, next(self.seq)):
                self._finish(r, now)
        for r in d.joining:
            self._first_token(r, now)
            self._join(d, r, now)
        d.joining.clear()
        self._start_decode(d, now)

    def _finish(self, r: Req, now: float) -> None:
        r.end = now
        assert r.decode is not None
        self.d_role.charge(r.decode, -r.d_charge)
        self.d_role.hold(r.decode, r.prefix, -1)
        if r.client >= 0:
            self._next_for(r.client, now)

    def _result(self, wall_s: float) -> SimResult:
        measured = [r for r in self.reqs if r.arrival >= self.warmup_s] or self.reqs
        ok = [r for r in measured if not math.isnan(r.end)]
        ttft = np.array([r.first - r.arrival if not math.isnan(r.first) else math.inf for r in measured])
        e2e = np.array([r.end - r.arrival for r in ok])
        first_send = min((r.arrival for r in measured), default=0.0)
        last_end = max((r.end for r in ok), default=first_send)
        span = max(last_end - first_send, 1e-9)
        values, weights = self._itl_points()
        good, met = 0, math.nan
        if self.slo is not None:
            ttft_s, itl_s = self.slo
            good = sum(1 for r in ok if r.first - r.arrival <= ttft_s
                       and (r.n_out < 2 or (r.end - r.first) / (r.n_out - 1) <= itl_s))
            met = good / len(measured) if measured else math.nan
        segments = [(n, b) for _, _, n, b, t0 in self.itl if t0 >= self.warmup_s]
        steps = sum(n for n, _ in segments)
        batch_tokens = sum(n * b for n, b in segments)
        ends = [r.end for r in self.reqs if not math.isnan(r.end)]
        start = min((r.arrival for r in self.reqs), default=0.0)
        run_span = max(max(ends, default=start) - start, 1e-9)
        return SimResult(
            num_prefill=self.cluster.num_prefill, num_decode=self.cluster.num_decode,
            requests=len(measured), completed=len(ok), duration_s=span,
            ttft=Percentiles.of(ttft), itl=Percentiles.weighted(values, weights), e2e=Percentiles.of(e2e),
            request_throughput=len(ok) / span, output_throughput=sum(r.n_out for r in ok) / span,
            goodput=good / span if self.slo is not None else math.nan, slo_attainment=met,
            prefill_utilisation=sum(p.busy_s for p in self.prefill) / (run_span * len(self.prefill)),
            decode_utilisation=sum(d.busy_s for d in self.decode) / (run_span * len(self.decode)),
            mean_decode_batch=batch_tokens / steps if steps else 0.0,
            events=self.n_events, wall_s=wall_s,
            prefill_stretch=_stretch(self.prefill), decode_stretch=_stretch(self.decode),
            prefill_cpu_stretch=_stretch(self.prefill, cpu=True),
            decode_cpu_stretch=_stretch(self.decode, cpu=True),
            wait_stretch=_wait([*self.prefill, *self.decode]),
        )

    def _itl_points(self) -> tuple[np.ndarray, np.ndarray]:
        """Each segment's step times (an arithmetic series) as at most ``ITL_POINTS`` weighted points."""
        values: list[float] = []
        weights: list[float] = []
        for a, inc, n, batch, t0 in self.itl:
            if t0 < self.warmup_s:
                continue
            if inc == 0 or n == 1:
                values.append(a + inc * (n - 1) / 2)
                weights.append(float(n * batch))
                continue
            m = min(n, ITL_POINTS)
            for j in range(m):
                values.append(a + inc * ((j + 0.5) * n / m - 0.5))
                weights.append(n * batch / m)
        return np.array(values), np.array(weights)


def _stretch(workers: list[PrefillSim] | list[DecodeSim], cpu: bool = False) -> float:
    """Stepping wall time (``cpu``: CPU time, what contention adds) over the same steps' costs at full
    speed (1 when nothing stepped)."""
    work = sum(w.work_s for w in workers)
    return sum(w.cpu_s if cpu else w.busy_s for w in workers) / work if work > 0 else 1.0


def _wait(workers: list[PrefillSim | DecodeSim]) -> float:
    """Stepping wall time over stepping CPU time, every worker pooled: the wait for a core."""
    cpu = sum(w.cpu_s for w in workers)
    return sum(w.busy_s for w in workers) / cpu if cpu > 0 else 1.0


def simulate(profile: Profile, cluster: Cluster, specs: Iterable[RequestSpec], *,
             concurrency: int | None = None, duration_s: float | None = None,
             slo: tuple[float, float] | None = None, warmup_s: float = 0.0,
             time_limit_s: float | None = None, host_cores: float | None = None,
             prefill_host_cores: float | None = None, decode_contention: float = 1.0,
             prefill_contention: float = 1.0) -> SimResult:
    """Run one simulation (``slo``: (TTFT, mean ITL) bounds in seconds for goodput; ``host_cores``: the
    workers share that many CPU cores, ``prefill_host_cores`` the figure for prefill steps; the
    contentions: a step's CPU time beside another busy worker, per role; see the module docstring)."""
    return Simulation(profile, cluster, specs, concurrency=concurrency, duration_s=duration_s, slo=slo,
                      warmup_s=warmup_s, time_limit_s=time_limit_s, host_cores=host_cores,
                      prefill_host_cores=prefill_host_cores, decode_contention=decode_contention,
                      prefill_contention=prefill_contention).run()

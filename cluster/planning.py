"""``pdserve serve --planner``: the loop that holds the SLO by adding and draining workers while serving.

Every ``--planner-interval`` seconds ``PlannerLoop.step`` reads what the router served over the last
``WINDOW_INTERVALS`` intervals (``router.load_window``: rate, prompt and output sizes, prefix hits,
TTFT and per-request inter-token latencies; a request's ITL is known only when it ends, so one
interval alone may hold too few) and the workers' queues and KV use (the worker table's stats,
refreshed every 0.1 s), asks ``planner.live.LivePlanner`` (the simulator with the live profile,
the SLO feedback and the hysteresis) for a decision, and carries it out through
``cluster.fleet.Fleet``: ``add`` starts a worker of the role in a new placement group and waits until
it has joined routing; ``remove`` drains the role's newest worker (``router.drain``, by
``--planner-drain-deadline``) and removes its actor and placement group. One action at a time;
the samples taken before and while it ran are dropped, so the next decision measures the new split.

Every decision is logged (logger ``pdserve.planner``), counted in
``pdserve:planner_decisions_total{action,role,code}``, sets ``pdserve:planner_workers{role}`` and
``pdserve:planner_target_workers{role}`` and the measured and predicted p90 gauges, and becomes a
``planner.decision`` span with an event named after the action and the reason when tracing is on.
An action that fails is logged and counted (``pdserve:planner_failures_total{action,role}``); the
loop goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge

from cluster.config import PlannerOptions
from cluster.fleet import Fleet
from planner.live import Decision, LivePlanner, Observed, p90
from planner.profile import load_profile
from planner.sizing import Bounds, Slo
from router.load_window import Served
from router.worker_table import WorkerTable
from telemetry.tracing import Tracing, end_span

log = logging.getLogger("pdserve.planner")
MIN_SAMPLES = 3  # latency samples a p90 needs in the window before the planner trusts it
WINDOW_INTERVALS = 3  # intervals the measurements span
ROLES = ("prefill", "decode")


def observe(served: Served, table: WorkerTable, min_samples: int = MIN_SAMPLES) -> Observed:
    """One interval's ``Observed``: the router's samples plus the decode workers' queues and KV use."""
    decode = table.live("decode")
    stats = [w.stats for w in decode if w.stats is not None]
    n, prompted = served.requests, served.first_prompt_tokens
    kv = max((s.kv.used_blocks / s.kv.num_blocks for s in stats if s.kv.num_blocks), default=0.0)
    return Observed(
        seconds=served.seconds, requests=n,
        mean_input_tokens=served.prompt_tokens / n if n else 0.0,
        mean_output_tokens=served.output_tokens / n if n else 0.0,
        prefix_hit_rate=served.cached_tokens / prompted if prompted else 0.0,
        ttft_p90_s=p90(served.ttft, min_samples), itl_p90_s=p90(served.itl, min_samples),
        decode_waiting=sum(s.requests.waiting for s in stats),
        decode_kv_usage=kv,
        num_prefill=len(table.live("prefill")), num_decode=len(decode))


class PlannerMetrics:
    """The planner's Prometheus families, in a registry of their own (``/metrics`` answers it too)."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.decisions = Counter("pdserve:planner_decisions",
                                 "Planner decisions by action, role and reason code.",
                                 ["action", "role", "code"], registry=r)
        self.failures = Counter("pdserve:planner_failures", "Planner actions that failed.",
                                ["action", "role"], registry=r)
        self.workers = Gauge("pdserve:planner_workers", "Workers routed to now, by role.", ["role"],
                             registry=r)
        self.target = Gauge("pdserve:planner_target_workers", "The planner's target worker count, by role.",
                            ["role"], registry=r)
        self.measured = Gauge("pdserve:planner_measured_p90_seconds",
                              "TTFT and ITL p90 the router measured over the last interval.", ["metric"],
                              registry=r)
        self.predicted = Gauge("pdserve:planner_predicted_p90_seconds",
                               "TTFT and ITL p90 the simulator predicts at the target split.", ["metric"],
                               registry=r)

    def record(self, d: Decision, o: Observed) -> None:
        self.decisions.labels(d.action, d.role or "", d.code).inc()
        for role, now, target in (("prefill", o.num_prefill, d.target_prefill),
                                  ("decode", o.num_decode, d.target_decode)):
            self.workers.labels(role).set(now)
            self.target.labels(role).set(target)
        for metric, measured, predicted in (("ttft", o.ttft_p90_s, d.predicted_ttft_p90_s),
                                            ("itl", o.itl_p90_s, d.predicted_itl_p90_s)):
            if measured is not None:
                self.measured.labels(metric).set(measured)
            if predicted is not None:
                self.predicted.labels(metric).set(predicted)


@dataclass(frozen=True)
class Outcome:
    """A decision and what came of it: the worker added or removed, or the error."""

    decision: Decision
    observed: Observed
    worker_id: str | None = None
    error: str | None = None


def make_planner(options: PlannerOptions, num_prefill: int, num_decode: int) -> LivePlanner:
    """The rule the loop follows, with the profile read now (before any worker starts): ValueError
    naming ``--planner-profile`` when it cannot be read."""
    lo_p, hi_p, lo_d, hi_d = options.bounds(num_prefill, num_decode)
    if not options.profile:
        raise ValueError("--planner needs --planner-profile PATH (write one with `pdserve profile`)")
    try:
        profile = load_profile(options.profile)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"--planner-profile {options.profile}: {type(exc).__name__}: {exc}") from None
    return LivePlanner(profile, Slo(ttft_p90_s=options.slo[0], itl_p90_s=options.slo[1]),
                       Bounds(min_prefill=lo_p, max_prefill=hi_p, min_decode=lo_d, max_decode=hi_d),
                       hysteresis=options.hysteresis)


class PlannerLoop:
    def __init__(self, options: PlannerOptions, planner: LivePlanner, fleet: Fleet,
                 tracing: Tracing | None = None) -> None:
        self.planner = planner
        self.options = options
        self.fleet = fleet
        self.tracing = tracing or Tracing()
        self.metrics = PlannerMetrics()
        self.history: list[Outcome] = []  # the last decisions, newest last (bounded)
        self._windows: deque[Served] = deque(maxlen=WINDOW_INTERVALS)
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None:
            self.fleet.client.window.take()  # start-up is no load sample
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.options.interval)
            try:
                await self.step()
            except Exception:  # the loop must outlive a bad interval
                log.exception("planner step failed")

    async def step(self) -> Outcome:
        client = self.fleet.client
        self._windows.append(client.window.take())
        observed = observe(Served.merge(list(self._windows)), client.table)
        d = await asyncio.to_thread(self.planner.decide, observed)  # simulations: off the event loop
        self.metrics.record(d, observed)
        log.info("planner: %s%s (%s) -> target %dP:%dD: %s", d.action, f" {d.role}" if d.role else "", d.code,
                 d.target_prefill, d.target_decode, d.reason)
        outcome = Outcome(d, observed)
        if d.action != "hold" and d.role is not None:
            started = time.monotonic()
            try:
                worker_id = await self._act(d.action, d.role)
                outcome = Outcome(d, observed, worker_id=worker_id)
                log.info("planner: %s %s done in %.1f s", d.action, worker_id, time.monotonic() - started)
            except Exception as exc:
                self.metrics.failures.labels(d.action, d.role).inc()
                outcome = Outcome(d, observed, error=f"{type(exc).__name__}: {exc}")
                log.warning("planner: %s %s failed: %s", d.action, d.role, outcome.error)
            for role in ROLES:  # the counts the action left
                self.metrics.workers.labels(role).set(len(self.fleet.live(role)))
            self.planner.reset()
            client.window.take()  # what was measured before and during the change says nothing of the
            self._windows.clear()  # new split
        self._trace(outcome)
        self.history = [*self.history[-63:], outcome]
        return outcome

    async def _act(self, action: str, role: str) -> str:
        if action == "add":
            return await self.fleet.add(role)
        victim = self.fleet.live(role)[-1].worker_id  # the newest
        await self.fleet.drain(victim, self.options.drain_deadline)
        return victim

    def _trace(self, outcome: Outcome) -> None:
        if not self.tracing.enabled:
            return
        d, o = outcome.decision, outcome.observed
        span = self.tracing.start_span("planner.decision", None, attributes={
            "pdserve.planner.action": d.action, "pdserve.planner.role": d.role or "",
            "pdserve.planner.code": d.code, "pdserve.planner.reason": d.reason,
            "pdserve.planner.target_prefill": d.target_prefill,
            "pdserve.planner.target_decode": d.target_decode,
            "pdserve.planner.num_prefill": o.num_prefill, "pdserve.planner.num_decode": o.num_decode,
            "pdserve.planner.rate_rps": o.rate_rps, "pdserve.planner.worker": outcome.worker_id or ""})
        if span is not None:
            span.add_event(d.action, {"reason": d.reason, "code": d.code})
        end_span(span, outcome.error)

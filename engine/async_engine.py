"""AsyncEngine: an LLMEngine driven by one asyncio task, for actors that serve many callers.

Only the loop task calls ``engine.step()`` (on the engine's own thread, so the
event loop stays responsive); every other mutation goes through ``mutate`` and
every read of engine state through ``read``: both run between steps under the
same lock, on that same thread, so the engine is never touched by two threads at
once (a read straight from the event loop while a step runs may see a dict
change size under it).
Each request's outputs go to its own queue; ``stream`` yields them in per-step
batches, and a consumer that stops early (a client that went away) aborts the
request, freeing its blocks. Hand-off: after delivering a step's outputs the loop
yields once before taking the lock for the next step; a consumer woken by that
delivery runs in that turn, so a ``read`` or ``mutate`` it makes right away comes
before the next step.

Step clocks (``StepClock``): every step's wall time and the CPU time of the thread that ran it
(``time.perf_counter`` and ``time.thread_time``, read in the stepping thread just before and after
``engine.step()``: four clock reads a step) are added to running totals with the step count.
Wall / CPU over many steps is how much the host stretched the steps: a worker that shares its cores
with other busy processes waits for one, and that wait is wall time without CPU. The CPU counted is
the stepping thread's alone: with one torch thread (the workers' default) the whole forward runs on
it; with more, torch's intra-op threads' CPU is missing and the ratio overstates the stretch.
Beside them, what each step computed (``engine/step_work.py``: decode rows and their context, or
prompt tokens and attended pairs, read from ``LLMEngine.last_step_work`` after the step) goes into
``StepClock.work`` with that step's wall time, split into decode-only and prompt-carrying steps: what
the profile prices, so wall over priced seconds of the same steps is the stretch against the worker
measured alone, which wall / CPU cannot see (two workers computing at once slow each other's
arithmetic through shared caches and memory bandwidth: more CPU a step, not only more waiting).
The worker reports the totals in ``WorkerStats`` (``step_count``, ``step_wall_seconds``,
``step_cpu_seconds``, ``step_decode_*``, ``step_prefill_*``), which ``pdserve profile --calibrate``
reads from ``GET /v1/workers``.

One engine thread (``EngineThread``): the engine is built, stepped, read and mutated on one thread
of its own, never on the event loop's or a pool's. libgomp keeps one thread team per thread that
opens a parallel region, and once a process holds more OpenMP threads than it has CPUs, every team
sleeps in the kernel at a barrier after a short spin: a second team (a model loaded on one thread and
stepped on another) makes the native decoder's barriers sleep and wake every step. Figures:
docs/benchmarks.md, "One engine thread".
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

import torch

from engine.engine import LLMEngine
from engine.outputs import RequestOutput
from engine.step_work import StepTotals, StepWork

T = TypeVar("T")


class EngineThread:
    """The one thread that touches an engine (see the module docstring): ``call`` runs a function on
    it and waits (building the engine), ``run`` awaits one from the event loop; both in a copy of the
    caller's context variables, as ``asyncio.to_thread`` does (a span opened there has its trace).
    ``num_threads``, when given, is set as torch's thread count on it first. ``close`` lets it end
    once idle."""

    def __init__(self, num_threads: int | None = None) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
        if num_threads is not None:
            self.call(torch.set_num_threads, num_threads)

    def call(self, fn: Callable[..., T], *args: object, **kwargs: object) -> T:
        return self._submit(functools.partial(fn, *args, **kwargs)).result()

    async def run(self, fn: Callable[..., T], *args: object) -> T:
        return await asyncio.wrap_future(self._submit(functools.partial(fn, *args)))

    def _submit(self, job: Callable[[], T]) -> Future[T]:
        return self._pool.submit(contextvars.copy_context().run, job)

    def close(self) -> None:
        self._pool.shutdown(wait=False)


@dataclass
class StepClock:
    """Running totals over the engine's steps: how many, their wall seconds, and the CPU seconds of
    the thread that ran them (see the module docstring)."""

    steps: int = 0
    wall_s: float = 0.0
    cpu_s: float = 0.0
    work: StepTotals = field(default_factory=StepTotals)

    def timed(self, step: Callable[[], T], work: Callable[[], StepWork | None] = lambda: None) -> T:
        """Run ``step()`` in this thread and add its wall and thread CPU time, and ``work()`` (what
        the step computed, read after it) with its wall time."""
        w0, c0 = time.perf_counter(), time.thread_time()
        try:
            return step()
        finally:
            self.cpu_s += time.thread_time() - c0
            wall = time.perf_counter() - w0
            self.wall_s += wall
            self.steps += 1
            done = work()
            if done is not None:
                self.work.add(done, wall)


class StepGate(Protocol):
    """Called on the engine thread around every step: ``before`` it, and ``after`` it with whether the
    engine still has work (``worker/core_gates.py`` lends and borrows cores there)."""

    def before_step(self) -> None: ...

    def after_step(self, more: bool) -> None: ...


class AsyncEngine:
    """``thread``: the engine's own thread (see the module docstring); one is made when not given.
    ``gate``: called around every step on that thread (``StepGate``)."""

    def __init__(self, engine: LLMEngine, thread: EngineThread | None = None, gate: StepGate | None = None
                 ) -> None:
        self.engine = engine
        self.gate = gate
        self.thread = thread if thread is not None else EngineThread()
        self._lock = asyncio.Lock()
        self._wake = asyncio.Event()
        self._queues: dict[str, asyncio.Queue[RequestOutput]] = {}
        self._task: asyncio.Task[None] | None = None
        self.error: BaseException | None = None
        self.clock = StepClock()

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def mutate(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run ``fn(engine)`` between steps, then wake the loop."""
        self.start()
        async with self._lock:
            result = await self.thread.run(fn, self.engine)
        self._wake.set()
        return result

    async def read(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run ``fn(engine)`` between steps without waking the loop (stats, digests, events)."""
        async with self._lock:
            return await self.thread.run(fn, self.engine)

    async def abort(self, request_id: str) -> RequestOutput | None:
        """Abort ``request_id`` between steps and end its stream: its reader gets the finished
        ``abort`` output, where it would otherwise wait for a next output that never comes (until its
        own timeout), holding its caller's read (a Ray stream to the router) open as long."""
        output = await self.mutate(lambda e: e.abort_request(request_id))
        if output is not None:
            self.deliver(output)
        return output

    def open_stream(self, request_id: str) -> None:
        """Register a request's output queue before the request can produce anything."""
        self._queues.setdefault(request_id, asyncio.Queue())

    def deliver(self, output: RequestOutput) -> None:
        queue = self._queues.get(output.request_id)
        if queue is not None:
            queue.put_nowait(output)

    async def stream(self, request_id: str, timeout: float) -> AsyncIterator[list[RequestOutput]]:
        """Yield the request's outputs in batches until it finishes; abort it if the consumer leaves.

        ``timeout`` bounds the wait for each batch; past it the request is aborted
        and TimeoutError raised.
        """
        queue = self._queues.setdefault(request_id, asyncio.Queue())
        finished = False
        try:
            while not finished:
                # not ``wait_for``: it runs the get as a task of its own, so the caller resumes one
                # loop turn after the delivery, when the engine loop has taken the lock for the next
                # step; a caller that reads the engine once its request ends (a prefill worker's
                # lease) then waits that whole step
                async with asyncio.timeout(timeout):
                    first = await queue.get()
                batch = [first]
                while not queue.empty():
                    batch.append(queue.get_nowait())
                finished = batch[-1].finished
                if finished and batch[-1].finish_reason == "abort" and self.error is not None:
                    raise RuntimeError(f"engine loop failed: {self.error!r}") from self.error
                yield batch
        finally:
            self._queues.pop(request_id, None)
            if not finished:
                await self.mutate(lambda e: e.abort_request(request_id))

    def _work(self) -> StepWork | None:
        return self.engine.last_step_work

    def _step(self) -> list[RequestOutput]:
        gate = self.gate
        if gate is None:
            return self.engine.step()
        gate.before_step()
        try:
            return self.engine.step()
        finally:
            gate.after_step(self.engine.has_unfinished())

    async def _run(self) -> None:
        while True:
            if not self.engine.has_unfinished():
                self._wake.clear()
                await self._wake.wait()
                continue
            try:
                async with self._lock:
                    outputs = await self.thread.run(self.clock.timed, self._step, self._work)
            except Exception as exc:  # the loop must not die silently: end every waiter's stream
                self.error = exc
                for rid in list(self._queues):
                    aborted = self.engine.abort_request(rid)
                    if aborted is not None:
                        self.deliver(aborted)
                raise
            for out in outputs:
                self.deliver(out)
            await asyncio.sleep(0)

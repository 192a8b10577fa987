"""The steps' side of shared cores (``worker/core_share.py`` has the per-node files and their contract):
the ``engine.async_engine.StepGate``s a worker's engine thread calls around each step, and
``step_gate``, which decides what a worker borrows and when its prompt chunks ask."""

from __future__ import annotations

import os
from collections.abc import Callable

import msgspec
import torch

from messages.wire import CoreShareStats
from worker.core_share import CoreBorrower, CoreLender, share_key

# A prompt chunk asks busy lenders only while a prompt this long is left: a decode step on two threads
# takes more core time than on one, so turns pay for long prompts (whose wait on one core doubles)
# and not short ones (asking for 256-token chat prompts gained nothing at 4 and 16 clients and
# stalled every decode behind them; docs/benchmarks.md)
ASK_MIN_TOKENS = 512


class LendGate:
    """``engine.async_engine.StepGate`` of a lender: its cores back before each step, lent again when
    its engine has nothing left to run."""

    def __init__(self, lender: CoreLender) -> None:
        self.lender = lender

    def before_step(self) -> None:
        self.lender.claim()

    def after_step(self, more: bool) -> None:
        if not more:
            self.lender.release()
        elif self.lender.asked():
            self.lender.yield_()

    def stats(self) -> CoreShareStats:
        lender = self.lender
        return CoreShareStats(reclaim_waits=lender.waits, reclaim_seconds=lender.wait_s,
                              reclaim_late=lender.late, yields=lender.yields)

    def close(self) -> None:
        self.lender.close()


class BorrowGate:
    """``engine.async_engine.StepGate`` of a borrower: a step that ``may_borrow()`` allows runs on its
    own ``threads`` plus whatever idle lenders lend, up to the CPUs this process may run on, given back
    after the step. Only steps whose values do not depend on the thread count: decode-only steps (the
    native decode kernels compute each output on one thread, in one order), and prompt chunks only
    where the engine says so (``step_gate``); torch's products are not promised to, and a prompt
    computed here should not depend on the load. The premise is Ray's: a worker's CPUs are the node's
    cores it reserved, so an idle lender's cores are idle; where Ray is told of more CPUs than the node
    has (the test suite), turn sharing off."""

    def __init__(self, borrower: CoreBorrower, threads: int, may_borrow: Callable[[], bool],
                 asks: Callable[[], bool] = lambda: False) -> None:
        self.borrower = borrower
        self.threads = threads
        self.may_borrow = may_borrow
        self.asks = asks  # the next step is a prompt chunk that asks busy lenders to yield
        self.cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        self._extra = 0

    def will_ask(self) -> bool:
        return self.threads < self.cpus and self.may_borrow() and self.asks()

    def before_step(self, ask: bool = False) -> None:
        """``ask``: the step is a prompt chunk that asks busy lenders (``will_ask``, asked once a step by
        ``ShareGate``)."""
        if self.threads >= self.cpus or not self.may_borrow():
            return
        self._extra = self.borrower.borrow(ask)
        if self._extra:
            torch.set_num_threads(min(self.cpus, self.threads + self._extra))

    def after_step(self, more: bool) -> None:
        if self._extra:
            torch.set_num_threads(self.threads)
            self._extra = 0
        self.borrower.give_back()

    def stats(self) -> CoreShareStats:
        b = self.borrower
        return CoreShareStats(borrowed_steps=b.steps, borrowed_threads=b.threads, asked_steps=b.asks,
                              ask_seconds=b.ask_s)

    def close(self) -> None:
        self.borrower.close()


class ShareGate:
    """``engine.async_engine.StepGate`` of a worker that lends and borrows: before each step, the ask of a
    prompt chunk (``BorrowGate.asks``), then its own cores back (``LendGate``), then whatever workers of
    its deployment on the node lend or yield, for the steps ``may_borrow`` allows (``BorrowGate``).
    After the step the borrowed cores go back first, then its own are lent again if its engine has
    nothing left to run, or yielded if a borrower asks. A prompt chunk that ran on lent or yielded
    cores lends its own before giving those back while it has more to run: the lender's next step runs
    on them, and this worker takes them back (and asks again) before its next chunk."""

    def __init__(self, lend: LendGate, borrow: BorrowGate) -> None:
        self.lend, self.borrow = lend, borrow

    def before_step(self) -> None:
        ask = self.borrow.will_ask()
        if ask:
            self.borrow.borrower.ask()
        self.lend.before_step()
        self.borrow.before_step(ask)

    def after_step(self, more: bool) -> None:
        if more and self.borrow.borrower.got_by_asking:
            self.lend.lender.release()
        self.borrow.after_step(more)
        self.lend.after_step(more)

    def stats(self) -> CoreShareStats:
        lent, borrowed = self.lend.stats(), self.borrow.stats()
        return msgspec.structs.replace(borrowed, reclaim_waits=lent.reclaim_waits,
                                       reclaim_seconds=lent.reclaim_seconds, reclaim_late=lent.reclaim_late,
                                       yields=lent.yields)

    def close(self) -> None:
        self.borrow.close()
        self.lend.close()


def node_id() -> str:
    """This process's Ray node (its host name outside Ray)."""
    try:
        import ray

        if ray.is_initialized():
            return str(ray.get_runtime_context().get_node_id())
    except ImportError:
        pass
    import socket

    return socket.gethostname()


def step_gate(deployment: str, name: str, threads: int, decode_only: Callable[[], bool],
              prompts_invariant: bool, prompt_left: Callable[[], int] = lambda: 0) -> ShareGate:
    """Every worker of ``deployment`` on this node lends its cores while idle and borrows idle ones for a
    decode-only step, and for every step when its prompt chunks are the same on any thread count
    (``prompts_invariant``, ``LLMEngine.prompts_thread_invariant``): so an idle decode worker's cores
    compute a prefill worker's prompts, and an idle prefill worker's the decode steps. Such a prompt
    chunk also asks a busy worker to yield its cores after its current step (``core_share``) when a
    prompt of at least ``ASK_MIN_TOKENS`` is left to compute (``prompt_left``,
    ``LLMEngine.longest_prompt_left``), so a prefill worker beside a busy decode worker computes a long
    prompt on both, in turn with the decode steps. A borrowed prompt chunk keeps its full size: a lender
    that gets work meanwhile waits for it up to ``core_share.DEADLINE_S`` (``YIELD_DEADLINE_S`` after a yield;
    capping borrowed chunks at 256-1,024 tokens was measured and served less; docs/benchmarks.md)."""
    key = share_key(deployment, node_id())
    lender = CoreLender(key, name, threads)
    may_borrow = (lambda: True) if prompts_invariant else decode_only
    asks = (lambda: prompt_left() >= ASK_MIN_TOKENS) if prompts_invariant else (lambda: False)
    borrow = BorrowGate(CoreBorrower(key, own=lender.path), threads, may_borrow, asks)
    return ShareGate(LendGate(lender), borrow)

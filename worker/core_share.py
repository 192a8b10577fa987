"""Idle cores lent between the workers of one deployment on the same node, both ways.

A prefill worker computes in bursts: a batch of prompts, then nothing until the next arrives. A decode
worker beside it on the same node steps while it has requests, on its own cores only, and on CPU a
decode step on one core is bound by that core's share of memory bandwidth, about half of what two cores
read. The other way round, a long prompt on a prefill worker of one core takes twice what two cores
take, while the decode worker waits for it with nothing to run. So every worker lends its cores while
its engine has nothing to run, and borrows idle workers' cores for its own steps, giving them back
before the lender computes again: a decode worker's steps run on an idle prefill worker's threads too,
a prefill worker's prompt chunks on an idle decode worker's.

The contract, per lender (every worker) one file ``{directory}/{key}.{lender}.cores``, where ``key``
names the deployment and the node (``share_key``):

- An exclusive ``flock`` on the file means "the lender's cores are in use": the lender holds it while
  it has work; a borrower holds it for one step at most.
- Byte 0 is the lender's wish: 1 while it waits for its cores, so no borrower takes them again; bytes
  1-4 the number of threads it lends, bytes 5-8 its process id (int32s, little-endian): a borrower
  skips the file of a process that is gone.
- ``CoreLender.claim()``, on the lender's engine thread before a step, when it does not hold the lock:
  sets the wish, takes the lock (retrying every millisecond: a borrower's step ends within tens of
  milliseconds, a prompt chunk's within a few hundred), clears the wish. Bounded by ``deadline_s``: past
  it the lender computes without the lock (counted in ``late``), so a borrower that hangs never stalls
  the lender. ``release()`` when its
  engine has nothing left to run.
- ``CoreBorrower.borrow()``, on the borrower's engine thread before each step: takes the lock of every
  lender file whose wish is 0 without waiting, and answers how many threads it got; the step then runs
  on its own threads plus those (``torch.set_num_threads``). ``give_back()`` after the step unlocks
  them all.
- A process that dies holding a lock loses it (the kernel drops a dead process's ``flock``s). A lender's
  file outlives its process (Ray kills a worker without a hook): no borrower uses the file of a process
  that is gone, and the next lender started on the node removes such files (``remove_stale``).

Borrowers take decode-only steps (``BorrowGate``), whose values do not depend on the thread count, and
every step when the engine's prompt chunks do not either (``LLMEngine.prompts_thread_invariant``: the
native products and attention, a dense decoder), so sharing changes no token. A worker never borrows
its own file. The workers share only on CPU, without tensor parallelism, and only among one
deployment's workers on one node (``cluster/workers.py`` passes the deployment's name prefix;
``--no-share-cores`` turns it off). The premise is Ray's: a worker's CPUs are cores of the node
reserved for it, so an idle lender's cores are idle.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import os
import struct
import time
from collections.abc import Callable
from pathlib import Path

import torch

from messages.wire import CoreShareStats

DEFAULT_DIRECTORY = "/dev/shm" if os.path.isdir("/dev/shm") else "/tmp"
DEADLINE_S = 0.5  # the longest a lender waits for its cores back
RETRY_S = 0.001
RESCAN_S = 1.0  # how often a borrower looks for lender files that appeared or went away


def share_key(deployment: str, node_id: str) -> str:
    """The file prefix of one deployment's lenders on one node."""
    safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in f"{deployment}-{node_id}")
    return f"pdserve-cores-{safe}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return pid > 0


def _try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def remove_stale(directory: str = DEFAULT_DIRECTORY) -> int:
    """Remove the lender files of processes that are gone (a lender killed without closing), of any
    deployment; how many."""
    removed = 0
    for path in glob.glob(str(Path(directory) / "pdserve-cores-*.cores")):
        try:
            with open(path, "rb") as f:
                head = f.read(9)
            if len(head) == 9 and not _alive(struct.unpack("<ii", head[1:9])[1]):
                os.unlink(path)
                removed += 1
        except OSError:
            continue
    return removed


class CoreLender:
    """A prefill worker's side: see the module docstring."""

    def __init__(self, key: str, name: str, threads: int, directory: str = DEFAULT_DIRECTORY,
                 deadline_s: float = DEADLINE_S, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.path = Path(directory) / f"{key}.{name}.cores"
        self.deadline_s = deadline_s
        self._clock, self._sleep = clock, sleep  # the retry loop's (``claim``)
        remove_stale(directory)
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        os.pwrite(self._fd, b"\0" + struct.pack("<ii", threads, os.getpid()), 0)
        self.held = False
        self.late = 0  # claims that gave up waiting and computed without the lock
        self.waits = 0  # claims that found the cores lent out
        self.wait_s = 0.0  # seconds waited for them

    def claim(self) -> None:
        if self.held:
            return
        if _try_lock(self._fd):
            self.held = True
            return
        os.pwrite(self._fd, b"\1", 0)
        start = self._clock()
        self.waits += 1
        try:
            while not _try_lock(self._fd):
                if self._clock() - start > self.deadline_s:
                    self.late += 1
                    return
                self._sleep(RETRY_S)
            self.held = True
        finally:
            self.wait_s += self._clock() - start
            os.pwrite(self._fd, b"\0", 0)

    def release(self) -> None:
        if self.held:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            self.held = False

    def close(self) -> None:
        self.release()
        with contextlib.suppress(OSError):
            self.path.unlink()
        with contextlib.suppress(OSError):
            os.close(self._fd)


class CoreBorrower:
    """A decode worker's side: see the module docstring."""

    def __init__(self, key: str, directory: str = DEFAULT_DIRECTORY, own: Path | None = None) -> None:
        self.pattern = str(Path(directory) / f"{key}.*.cores")
        self.own = str(own) if own is not None else None  # this process's own lender file: never borrowed
        self._files: dict[str, int] = {}
        self._held: list[int] = []
        self._scanned = float("-inf")
        self.steps = 0  # steps that ran on borrowed threads
        self.threads = 0  # borrowed threads, summed over those steps

    def _scan(self) -> None:
        now = time.monotonic()
        if now - self._scanned < RESCAN_S:
            return
        self._scanned = now
        present = set(glob.glob(self.pattern)) - {self.own}
        for path in [p for p in self._files if p not in present]:
            with contextlib.suppress(OSError):
                os.close(self._files.pop(path))
        for path in present - set(self._files):
            with contextlib.suppress(OSError):
                self._files[path] = os.open(path, os.O_RDWR)

    def borrow(self) -> int:
        """Lock every idle lender's cores for one step; the threads they lend, summed."""
        self._scan()
        extra = 0
        for fd in self._files.values():
            try:
                head = os.pread(fd, 9, 0)
            except OSError:
                continue
            if len(head) < 9 or head[0] != 0:
                continue
            threads, pid = struct.unpack("<ii", head[1:9])
            if not _alive(pid) or not _try_lock(fd):
                continue
            self._held.append(fd)
            extra += max(0, threads)
        if extra:
            self.steps += 1
            self.threads += extra
        return extra

    def give_back(self) -> None:
        for fd in self._held:
            with contextlib.suppress(OSError):
                fcntl.flock(fd, fcntl.LOCK_UN)
        self._held.clear()

    def close(self) -> None:
        self.give_back()
        for fd in self._files.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        self._files.clear()


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

    def stats(self) -> CoreShareStats:
        lender = self.lender
        return CoreShareStats(reclaim_waits=lender.waits, reclaim_seconds=lender.wait_s,
                              reclaim_late=lender.late)

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

    def __init__(self, borrower: CoreBorrower, threads: int, may_borrow: Callable[[], bool]) -> None:
        self.borrower = borrower
        self.threads = threads
        self.may_borrow = may_borrow
        self.cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        self._extra = 0

    def before_step(self) -> None:
        if self.threads >= self.cpus or not self.may_borrow():
            return
        self._extra = self.borrower.borrow()
        if self._extra:
            torch.set_num_threads(min(self.cpus, self.threads + self._extra))

    def after_step(self, more: bool) -> None:
        if self._extra:
            torch.set_num_threads(self.threads)
            self._extra = 0
        self.borrower.give_back()

    def stats(self) -> CoreShareStats:
        return CoreShareStats(borrowed_steps=self.borrower.steps, borrowed_threads=self.borrower.threads)

    def close(self) -> None:
        self.borrower.close()


class ShareGate:
    """``engine.async_engine.StepGate`` of a worker that lends and borrows: its own cores back before each
    step (``LendGate``), then whatever idle workers of its deployment on the node lend, for the steps
    ``may_borrow`` allows (``BorrowGate``); after the step the borrowed cores go back first, then its own
    are lent again if its engine has nothing left to run."""

    def __init__(self, lend: LendGate, borrow: BorrowGate) -> None:
        self.lend, self.borrow = lend, borrow

    def before_step(self) -> None:
        self.lend.before_step()
        self.borrow.before_step()

    def after_step(self, more: bool) -> None:
        self.borrow.after_step(more)
        self.lend.after_step(more)

    def stats(self) -> CoreShareStats:
        lent, borrowed = self.lend.stats(), self.borrow.stats()
        return CoreShareStats(borrowed_steps=borrowed.borrowed_steps,
                              borrowed_threads=borrowed.borrowed_threads, reclaim_waits=lent.reclaim_waits,
                              reclaim_seconds=lent.reclaim_seconds, reclaim_late=lent.reclaim_late)

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
              prompts_invariant: bool) -> ShareGate:
    """Every worker of ``deployment`` on this node lends its cores while idle and borrows idle ones for a
    decode-only step, and for every step when its prompt chunks are the same on any thread count
    (``prompts_invariant``, ``LLMEngine.prompts_thread_invariant``): so an idle decode worker's cores
    compute a prefill worker's prompts, and an idle prefill worker's the decode steps. A borrowed prompt
    chunk keeps its full size: a lender that gets work meanwhile waits for it up to ``DEADLINE_S``
    (capping borrowed chunks at 256-1,024 tokens was measured and served less; docs/benchmarks.md)."""
    key = share_key(deployment, node_id())
    lender = CoreLender(key, name, threads)
    may_borrow = (lambda: True) if prompts_invariant else decode_only
    borrow = BorrowGate(CoreBorrower(key, own=lender.path), threads, may_borrow)
    return ShareGate(LendGate(lender), borrow)

"""Idle cores lent between the workers of one deployment on the same node, both ways.

A prefill worker computes in bursts: a batch of prompts, then nothing until the next arrives. A decode
worker beside it on the same node steps while it has requests, on its own cores only, and on CPU a
decode step on one core is bound by that core's share of memory bandwidth, about half of what two cores
read. The other way round, a long prompt on a prefill worker of one core takes twice what two cores
take, while the decode worker waits for it with nothing to run. So every worker lends its cores while
its engine has nothing to run, and borrows idle workers' cores for its own steps, giving them back
before the lender computes again: a decode worker's steps run on an idle prefill worker's threads too,
a prefill worker's prompt chunks on an idle decode worker's. A decode worker that is busy while a
long prompt waits yields its cores to its chunk between two of its steps.

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
- Byte 9 is a borrower's ask: 1 while a borrower with a prompt chunk to compute waits for the lender's
  cores although the lender is busy (``CoreBorrower.borrow(ask=True)``, for at most ``ASK_WAIT_S``). A
  busy lender that finds it set after a step yields: it unlocks and claims again before its next step
  (``core_gates.LendGate.after_step``), so the prompt chunk runs on both workers' threads and the
  lender's next step waits for it, up to ``YIELD_DEADLINE_S``. A borrower that got cores by asking lends
  its own while it waits to ask again (``core_gates.ShareGate``), so the lender's step between two
  prompt chunks runs on both workers' threads too. The two workers then take the node's cores in turn, a
  decode step and a prompt chunk, as one colocated worker's steps would: without it a long prompt on a
  prefill worker of one core takes twice what it takes colocated while the decode worker beside it steps
  small batches on the other core. Two borrowers asking one lender may clear each other's ask: the other
  then computes on its own threads after ``ASK_WAIT_S``.
- A process that dies holding a lock loses it (the kernel drops a dead process's ``flock``s). A lender's
  file outlives its process (Ray kills a worker without a hook): no borrower uses the file of a process
  that is gone, and the next lender started on the node removes such files (``remove_stale``).

Borrowers take decode-only steps (``core_gates.BorrowGate``), whose values do not depend on the thread
count, and every step when the engine's prompt chunks do not either
(``LLMEngine.prompts_thread_invariant``: the native products and attention, a dense decoder), so sharing
changes no token. A worker never borrows its own file. The workers share only on CPU, without tensor
parallelism, and only among one deployment's workers on one node (``cluster/workers.py`` passes the
deployment's name prefix; ``--no-share-cores`` turns it off). The premise is Ray's: a worker's CPUs are
cores of the node reserved for it, so an idle lender's cores are idle. The steps' side, the gates the
engine thread calls around each step, and the policy of who asks are ``worker/core_gates.py``.
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

DEFAULT_DIRECTORY = "/dev/shm" if os.path.isdir("/dev/shm") else "/tmp"
DEADLINE_S = 0.5  # the longest a lender waits for its cores back
YIELD_DEADLINE_S = 3.0  # ... after it yielded them to an asking borrower: a whole prompt chunk
ASK_WAIT_S = 0.15  # the longest a borrower with a prompt chunk waits for a busy lender to yield
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
                 deadline_s: float = DEADLINE_S, yield_deadline_s: float = YIELD_DEADLINE_S,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.path = Path(directory) / f"{key}.{name}.cores"
        self.deadline_s = deadline_s
        self._clock, self._sleep = clock, sleep  # the retry loop's (``claim``)
        remove_stale(directory)
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        self.yield_deadline_s = yield_deadline_s
        os.pwrite(self._fd, b"\0" + struct.pack("<ii", threads, os.getpid()) + b"\0", 0)
        self.held = False
        self.late = 0  # claims that gave up waiting and computed without the lock
        self.waits = 0  # claims that found the cores lent out
        self.wait_s = 0.0  # seconds waited for them
        self.yields = 0  # times a busy lender unlocked for an asking borrower
        self._yielded = False

    def claim(self) -> None:
        if self.held:
            return
        deadline = self.yield_deadline_s if self._yielded else self.deadline_s
        self._yielded = False
        if _try_lock(self._fd):
            self.held = True
            return
        os.pwrite(self._fd, b"\1", 0)
        start = self._clock()
        self.waits += 1
        try:
            while not _try_lock(self._fd):
                if self._clock() - start > deadline:
                    self.late += 1
                    return
                self._sleep(RETRY_S)
            self.held = True
        finally:
            self.wait_s += self._clock() - start
            os.pwrite(self._fd, b"\0", 0)

    def asked(self) -> bool:
        """Whether a borrower with a prompt chunk waits for these cores now."""
        return os.pread(self._fd, 1, 9) == b"\1"

    def yield_(self) -> None:
        """Unlock for an asking borrower while there is still work; the next ``claim`` waits up to
        ``yield_deadline_s`` for the borrower's chunk."""
        if self.held:
            self.release()
            self.yields += 1
            self._yielded = True

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

    def __init__(self, key: str, directory: str = DEFAULT_DIRECTORY, own: Path | None = None,
                 ask_wait_s: float = ASK_WAIT_S) -> None:
        self.pattern = str(Path(directory) / f"{key}.*.cores")
        self.own = str(own) if own is not None else None  # this process's own lender file: never borrowed
        self._files: dict[str, int] = {}
        self._held: list[int] = []
        self._scanned = float("-inf")
        self._asked: list[int] = []  # lender files whose ask this borrower set
        self.ask_wait_s = ask_wait_s
        self.steps = 0  # steps that ran on borrowed threads
        self.threads = 0  # borrowed threads, summed over those steps
        self.asks = 0  # prompt chunks that asked lenders for their cores
        self.ask_s = 0.0  # seconds they waited for busy lenders to yield
        self.got_by_asking = False  # the last ``borrow`` was a prompt chunk's and got cores

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

    def _lendable(self, fd: int) -> int:
        """The threads of a live lender that does not wait for its cores; 0 otherwise."""
        try:
            head = os.pread(fd, 9, 0)
        except OSError:
            return 0
        if len(head) < 9 or head[0] != 0:
            return 0
        threads, pid = struct.unpack("<ii", head[1:9])
        return max(0, threads) if _alive(pid) else 0

    def ask(self) -> None:
        """Set the ask on every live lender that does not wait for its cores (module docstring): before
        the asking worker takes its own cores back, so a lender stepping on them yields after it."""
        self._scan()
        for fd in self._files.values():
            if self._lendable(fd):
                self._set_ask(fd)

    def _set_ask(self, fd: int) -> None:
        if fd not in self._asked:
            with contextlib.suppress(OSError):
                os.pwrite(fd, b"\1", 9)
            self._asked.append(fd)

    def borrow(self, ask: bool = False) -> int:
        """Lock every idle lender's cores for one step; the threads they lend, summed. With ``ask`` (a
        prompt chunk), first ask the busy ones to yield and wait up to ``ask_wait_s`` for them."""
        self._scan()
        self.got_by_asking = False
        extra, busy = 0, []
        for fd in self._files.values():
            threads = self._lendable(fd)
            if not threads:
                continue
            if _try_lock(fd):
                self._held.append(fd)
                extra += threads
            elif ask:
                busy.append((fd, threads))
        if ask:
            self.asks += 1
            if busy:
                extra += self._wait_for_yields(busy)
        self._clear_asks()
        if extra:
            self.steps += 1
            self.threads += extra
            self.got_by_asking = ask
        return extra

    def _wait_for_yields(self, busy: list[tuple[int, int]]) -> int:
        for fd, _ in busy:
            self._set_ask(fd)
        start = time.monotonic()
        extra = 0
        while busy and time.monotonic() - start < self.ask_wait_s:
            time.sleep(RETRY_S)
            for fd, threads in list(busy):
                if _try_lock(fd):
                    busy.remove((fd, threads))
                    self._held.append(fd)
                    extra += threads
        self.ask_s += time.monotonic() - start
        return extra

    def _clear_asks(self) -> None:
        for fd in self._asked:
            with contextlib.suppress(OSError):
                os.pwrite(fd, b"\0", 9)
        self._asked.clear()

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

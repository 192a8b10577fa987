"""One tensor-parallel group: the collectives the sharded model runs, and the step plan rank 0 sends.

Contract (every rank of one worker, all on one host):

- rendezvous: rank 0 hosts a ``torch.distributed.TCPStore`` on 127.0.0.1 (``TpGroup.host``, port 0 picks
  one: ``port``); the other ranks join with that port. The group is its own process group object (no
  global ``init_process_group``), so a process may hold several, one per engine;
- backends: gloo on CPU; on CUDA the tensors go over NCCL and the plans over gloo (vLLM's split);
- deadlines: joining the group waits up to ``START_TIMEOUT_S`` (ranks are still loading); every
  collective after that waits at most ``timeout_s``; a rank whose peer died or hung raises
  ``TpError`` within it, never blocks for ever. While rank 0 is idle a keep-alive plan goes out every
  ``timeout_s / 3`` (a thread) so the others' wait for the next plan stays bounded too;
- order: rank 0 holds ``lock`` around every use (a step's plan and its forward's collectives, a
  keep-alive), so collectives never interleave across threads;
- plans: once per step rank 0 broadcasts a ``StepPlan`` (``engine/tp_messages.py``; its bytes from
  ``engine/tp_wire.py``: a length, then the bytes);
  ``Stop`` ends the other ranks' loop;
- calls: ``call(name, payload, local)`` (rank 0, under ``lock``) broadcasts a ``Call``; every other
  rank runs its handler for ``name`` (``ModelRunner.follow``'s ``handlers``) while rank 0 runs
  ``local``, and each answers a ``CallReply`` (a raised exception becomes ``error``), gathered to
  rank 0 in rank order. How a worker's ranks reach NIXL (``worker/tp_kv.py``): rank 0 asks, every
  rank acts on its own shard. A handler must finish well within ``timeout_s``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from engine.tp_messages import Call, CallReply, KeepAlive, Plan, StepPlan, Stop, run_handler

__all__ = ["Call", "CallReply", "KeepAlive", "Plan", "StepPlan", "Stop", "TpError", "TpGroup", "run_handler"]

DEFAULT_TP_TIMEOUT_S = 120.0
START_TIMEOUT_S = 300.0  # joining the group: the other ranks are still starting and loading weights


class TpError(RuntimeError):
    """A collective of the tensor-parallel group failed or passed its deadline (a rank died or hung)."""


def _gloo(store: dist.Store, rank: int, size: int, timeout: timedelta) -> Any:
    return dist.ProcessGroupGloo(store, rank, size, timeout)


class TpGroup:
    """Rank ``rank`` of ``size``; see the module docstring. ``device`` is where the model's tensors live."""

    host = "127.0.0.1"

    def __init__(self, rank: int, size: int, port: int = 0, timeout_s: float = DEFAULT_TP_TIMEOUT_S,
                 device: str = "cpu", store: dist.TCPStore | None = None) -> None:
        self.rank, self.size, self.timeout_s = rank, size, timeout_s
        self.timeout = timedelta(seconds=timeout_s)
        self.store = store or open_store(rank, size, port, timeout_s)
        self.port = self.store.port
        self.lock = threading.RLock()
        self._plans: Any = None
        self._tensors: Any = None
        self._device = torch.device(device)
        self._last_send = time.monotonic()
        self._closed = threading.Event()
        self._keepalive: threading.Thread | None = None
        self.plan_seconds = 0.0  # rank 0: time spent sending plans (per-step cost, measured)
        self.collective_seconds = 0.0  # time spent in the forward's collectives
        self.steps = 0

    def connect(self) -> None:
        """Join the process groups (waits for every rank, at most ``START_TIMEOUT_S`` or ``timeout_s``)."""
        try:
            start = timedelta(seconds=max(self.timeout_s, START_TIMEOUT_S))  # each op passes its own deadline
            self._plans = _gloo(dist.PrefixStore("plans/", self.store), self.rank, self.size, start)
            if self._device.type == "cuda":
                opts = dist.ProcessGroupNCCL.Options()
                opts._timeout = self.timeout
                self._tensors = dist.ProcessGroupNCCL(dist.PrefixStore("nccl/", self.store), self.rank,
                                                      self.size, opts)
            else:
                self._tensors = self._plans
        except RuntimeError as exc:
            raise TpError(f"tensor-parallel rank {self.rank} could not join its group of {self.size} "
                          f"in time: {exc}") from exc
        if self.rank == 0 and self.size > 1:
            self._keepalive = threading.Thread(target=self._keep_alive, name="tp-keepalive", daemon=True)
            self._keepalive.start()

    def _wait(self, work: Any, what: str) -> None:
        try:
            work.wait()
        except RuntimeError as exc:
            raise TpError(f"tensor-parallel {what} failed on rank {self.rank} of {self.size}: {exc}") from exc

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place."""
        t0 = time.perf_counter()
        opts = dist.AllreduceOptions()
        opts.timeout = self.timeout
        self._wait(self._tensors.allreduce([x], opts), "all-reduce")
        self.collective_seconds += time.perf_counter() - t0
        return x

    def gather_columns(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0: every rank's ``x`` (``[N, C]``) side by side, ``[N, size*C]``; other ranks: ``x``."""
        t0 = time.perf_counter()
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else []
        opts = dist.GatherOptions()
        opts.rootRank = 0
        opts.timeout = self.timeout
        self._wait(self._tensors.gather([parts] if parts else [], [x], opts), "gather")
        self.collective_seconds += time.perf_counter() - t0
        return torch.cat(parts, dim=1) if parts else x

    def min_int(self, value: int) -> int:
        """The smallest ``value`` over the ranks."""
        t = torch.tensor([value], dtype=torch.int64)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp(dist.ReduceOp.MIN)
        opts.timeout = self.timeout
        self._wait(self._plans.allreduce([t], opts), "all-reduce")
        return int(t.item())

    def _broadcast(self, t: torch.Tensor) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        opts.timeout = self.timeout
        self._wait(self._plans.broadcast([t], opts), "plan broadcast")

    def send_plan(self, plan: Plan) -> None:
        """Rank 0: the plan to every other rank (caller holds ``lock``)."""
        t0 = time.perf_counter()
        from engine.tp_wire import encode_plan

        data = encode_plan(plan)
        self._broadcast(torch.tensor([len(data)], dtype=torch.int64))
        self._broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        self._last_send = time.monotonic()
        if isinstance(plan, StepPlan):
            self.plan_seconds += time.perf_counter() - t0
            self.steps += 1

    def recv_plan(self) -> Plan:
        """Ranks 1..: the next plan rank 0 sends."""
        n = torch.zeros(1, dtype=torch.int64)
        self._broadcast(n)
        buf = torch.empty(int(n.item()), dtype=torch.uint8)
        self._broadcast(buf)
        from engine.tp_wire import decode_plan

        return decode_plan(buf.numpy().tobytes())

    def call(self, name: str, payload: bytes, local: Callable[[], bytes]) -> list[CallReply]:
        """Rank 0: run ``name`` on every other rank and ``local`` here; the replies, rank 0's first."""
        with self.lock:
            self.send_plan(Call(name, payload))
            return self.gather_replies(run_handler(local))

    def gather_replies(self, mine: CallReply) -> list[CallReply]:
        """Every rank's reply to the current ``Call``, gathered to rank 0 (others get ``[mine]``)."""
        from engine.tp_wire import decode_reply, encode_reply

        data = encode_reply(mine)
        longest = torch.tensor([len(data)], dtype=torch.int64)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp(dist.ReduceOp.MAX)
        opts.timeout = self.timeout
        self._wait(self._plans.allreduce([longest], opts), "reply length all-reduce")
        buf = torch.zeros(8 + int(longest.item()), dtype=torch.uint8)
        buf[:8] = torch.tensor([len(data)], dtype=torch.int64).view(torch.uint8)
        buf[8:8 + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        parts = [torch.empty_like(buf) for _ in range(self.size)] if self.rank == 0 else []
        gather = dist.GatherOptions()
        gather.rootRank = 0
        gather.timeout = self.timeout
        self._wait(self._plans.gather([parts] if parts else [], [buf], gather), "reply gather")
        if self.rank > 0:
            return [mine]
        replies = []
        for part in parts:
            n = int(part[:8].view(torch.int64).item())
            replies.append(decode_reply(part[8:8 + n].numpy().tobytes()))
        return replies

    def _keep_alive(self) -> None:
        period = self.timeout_s / 3
        while not self._closed.wait(period / 4):
            if time.monotonic() - self._last_send < period or not self.lock.acquire(timeout=period / 4):
                continue
            try:
                if not self._closed.is_set():
                    self.send_plan(KeepAlive())
            except TpError:
                return
            finally:
                self.lock.release()

    def close(self) -> None:
        """Rank 0: tell the other ranks to stop (best effort), then drop the groups. Idempotent."""
        if self._closed.is_set():
            return
        self._closed.set()
        if self.rank == 0 and self._plans is not None and self.size > 1 and self.lock.acquire(timeout=5):
            try:
                self.send_plan(Stop())
            except TpError:
                pass
            finally:
                self.lock.release()
        if self._keepalive is not None:
            self._keepalive.join(timeout=5)
        self._plans = self._tensors = None


def open_store(rank: int, size: int, port: int, timeout_s: float) -> dist.TCPStore:
    """Rank 0 hosts the rendezvous store (``port`` 0: any free port); the others connect to it."""
    return dist.TCPStore(TpGroup.host, port, size, rank == 0,
                         timedelta(seconds=max(timeout_s, START_TIMEOUT_S)), wait_for_workers=False)

"""Shared cores (worker/core_share.py): idle workers' threads lent to the steps of the others on the same
node (prefill to decode steps, decode to prompt chunks where they are thread-invariant), and back
before the lender computes again."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

from messages.wire import CoreShareStats
from tests.fakes import FakeClock
from tests.waiting import wait_until
from worker.core_gates import ASK_MIN_TOKENS, BorrowGate, LendGate, ShareGate, step_gate
from worker.core_share import RETRY_S, CoreBorrower, CoreLender, remove_stale, share_key

KEY = share_key("deploy-a", "node-1")


def test_an_idle_lenders_threads_go_to_one_borrower_for_one_step(tmp_path: Path) -> None:
    lender = CoreLender(KEY, "prefill-0", 3, str(tmp_path))
    first, second = CoreBorrower(KEY, str(tmp_path)), CoreBorrower(KEY, str(tmp_path))
    assert first.borrow() == 3
    assert second.borrow() == 0  # lent to one borrower at a time
    first.give_back()
    assert second.borrow() == 3
    second.give_back()
    lender.claim()  # free: no wait
    assert lender.held and lender.waits == 0
    assert first.borrow() == 0  # the lender computes
    lender.release()
    assert first.borrow() == 3 and first.steps == 2 and first.threads == 6
    first.give_back()
    assert CoreBorrower(share_key("deploy-b", "node-1"), str(tmp_path)).borrow() == 0  # another deployment
    assert CoreBorrower(share_key("deploy-a", "node-2"), str(tmp_path)).borrow() == 0  # another node
    lender.close()
    assert not lender.path.exists()


def test_a_lender_waits_for_the_borrowers_step_and_nobody_borrows_meanwhile(tmp_path: Path) -> None:
    """The lender's retry loop runs on a ``FakeClock``, in this thread: each retry's sleep is 0.1 s of the
    borrower's step, so the wait is the same on any machine."""
    clock = FakeClock()
    lender = CoreLender(KEY, "prefill-0", 1, str(tmp_path), clock=clock, sleep=lambda _: clock.sleep(0.1))
    borrower, other = CoreBorrower(KEY, str(tmp_path)), CoreBorrower(KEY, str(tmp_path))
    assert borrower.borrow() == 1
    seen: list[int] = []

    def borrowers_step() -> None:  # one retry: another borrower tries; the next: the step ends
        if not seen:
            seen.append(other.borrow())  # the lender's wish is set: no one takes its cores again
        else:
            borrower.give_back()

    clock.on_sleep = borrowers_step
    lender.claim()
    assert lender.held and seen == [0] and clock.sleeps == [0.1, 0.1]
    assert lender.waits == 1 and lender.late == 0 and lender.wait_s == pytest.approx(0.2)
    assert borrower.borrow() == 0  # held by the lender now
    lender.close()


def test_a_lender_computes_anyway_past_its_deadline(tmp_path: Path) -> None:
    clock = FakeClock()
    lender = CoreLender(KEY, "prefill-0", 1, str(tmp_path), deadline_s=0.1, clock=clock, sleep=clock.sleep)
    stuck = CoreBorrower(KEY, str(tmp_path))
    assert stuck.borrow() == 1  # and never gives back
    lender.claim()
    assert not lender.held and lender.late == 1
    assert lender.wait_s == pytest.approx(0.1 + RETRY_S) and set(clock.sleeps) == {RETRY_S}
    stuck.give_back()
    lender.claim()
    assert lender.held
    lender.close()


def _child(code: str, tmp_path: Path) -> subprocess.Popen[str]:
    script = textwrap.dedent(f"""
        import sys, time
        from worker.core_share import CoreBorrower, CoreLender
        {code}
        print("ready", flush=True)
        time.sleep(60)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                            cwd=Path(__file__).resolve().parents[2])
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def test_a_dead_processs_locks_and_files_do_not_count(tmp_path: Path) -> None:
    lender = CoreLender(KEY, "prefill-0", 1, str(tmp_path))
    child = _child(f"b = CoreBorrower({KEY!r}, {str(tmp_path)!r}); assert b.borrow() == 1", tmp_path)
    assert CoreBorrower(KEY, str(tmp_path)).borrow() == 0  # the child holds it
    child.send_signal(signal.SIGKILL)
    child.wait(10)
    lender.claim()  # the kernel dropped the dead borrower's lock
    assert lender.held and lender.waits == 0
    lender.close()

    dead = _child(f"CoreLender({KEY!r}, 'prefill-9', 2, {str(tmp_path)!r})", tmp_path)
    dead.send_signal(signal.SIGKILL)
    dead.wait(10)
    assert len(list(tmp_path.glob("*.cores"))) == 1
    assert CoreBorrower(KEY, str(tmp_path)).borrow() == 0  # its process is gone: its cores are not lent
    assert remove_stale(str(tmp_path)) == 1 and not list(tmp_path.glob("*.cores"))


def test_gates_lend_when_idle_and_borrow_only_for_decode_only_steps(tmp_path: Path) -> None:
    lend = LendGate(CoreLender(KEY, "prefill-0", 1, str(tmp_path)))
    decode_only = [True]
    borrow = BorrowGate(CoreBorrower(KEY, str(tmp_path)), 1, lambda: decode_only[0])
    borrow.cpus = 2
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        borrow.before_step()
        assert torch.get_num_threads() == 2
        borrow.after_step(True)
        assert torch.get_num_threads() == 1
        decode_only[0] = False  # a prompt to compute: its own threads only
        borrow.before_step()
        assert torch.get_num_threads() == 1
        borrow.after_step(True)
        decode_only[0] = True
        lend.before_step()
        lend.after_step(True)  # more work: still held
        borrow.before_step()
        assert torch.get_num_threads() == 1
        borrow.after_step(True)
        lend.after_step(False)  # idle: lent again
        borrow.before_step()
        assert torch.get_num_threads() == 2
        borrow.after_step(False)
        assert borrow.stats() == CoreShareStats(borrowed_steps=2, borrowed_threads=2)
        assert lend.stats().reclaim_late == 0
    finally:
        torch.set_num_threads(threads)
        lend.close()
        borrow.close()


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="needs sched_getaffinity")
def test_a_borrower_never_runs_more_threads_than_its_cpus(tmp_path: Path) -> None:
    lenders = [CoreLender(KEY, f"prefill-{i}", 1, str(tmp_path)) for i in range(3)]
    gate = BorrowGate(CoreBorrower(KEY, str(tmp_path)), 1, lambda: True)
    gate.cpus = 2
    threads = torch.get_num_threads()
    try:
        gate.before_step()
        assert torch.get_num_threads() == 2
        gate.after_step(False)
    finally:
        torch.set_num_threads(threads)
        for lender in lenders:
            lender.close()
        gate.close()



def test_workers_lend_both_ways_and_never_to_themselves(tmp_path: Path) -> None:
    """A prefill worker whose prompt chunks are thread-invariant runs them on an idle decode worker's
    thread, and the decode worker's decode-only steps on the idle prefill worker's; a busy worker lends
    nothing, a prompt chunk that is not invariant borrows nothing, and a worker alone borrows nothing."""

    def gate(name: str, may_borrow: list[bool], directory: Path = tmp_path) -> ShareGate:
        lender = CoreLender(KEY, name, 1, str(directory))
        borrower = CoreBorrower(KEY, str(directory), own=lender.path)
        share = ShareGate(LendGate(lender), BorrowGate(borrower, 1, lambda: may_borrow[0]))
        share.borrow.cpus = 2
        return share

    threads = torch.get_num_threads()
    prefill_invariant, decode_only = [True], [True]
    (tmp_path / "alone").mkdir()
    alone = gate("prefill-1", [True], tmp_path / "alone")
    prefill, decode = gate("prefill-0", prefill_invariant), gate("decode-0", decode_only)
    try:
        torch.set_num_threads(1)
        alone.before_step()  # its own file is never borrowed
        assert torch.get_num_threads() == 1
        alone.after_step(False)
        prefill.before_step()  # the decode worker is idle (never stepped): its thread computes the prompt
        assert torch.get_num_threads() == 2
        prefill.after_step(False)
        assert torch.get_num_threads() == 1
        decode.before_step()  # a decode-only step on the idle prefill worker's thread
        assert torch.get_num_threads() == 2
        decode.after_step(True)  # more to run: the decode worker keeps its own cores
        prefill.before_step()
        assert torch.get_num_threads() == 1
        prefill.after_step(False)
        decode_only[0] = False
        decode.before_step()  # not decode-only and not invariant: its own thread only
        assert torch.get_num_threads() == 1
        decode.after_step(False)  # idle: lent
        prefill_invariant[0] = False
        prefill.before_step()
        assert torch.get_num_threads() == 1
        prefill.after_step(False)
        assert prefill.stats() == CoreShareStats(borrowed_steps=1, borrowed_threads=1)
        assert decode.stats() == CoreShareStats(borrowed_steps=1, borrowed_threads=1)
    finally:
        torch.set_num_threads(threads)
        for share in (alone, prefill, decode):
            share.close()


def test_a_busy_lender_yields_to_an_asking_prompt_chunk_and_waits_for_it(tmp_path: Path) -> None:
    """A prompt chunk asks a busy lender for its cores; the lender yields after its step, and its next
    claim waits for the whole chunk (``yield_deadline_s``, not ``deadline_s``). Without an ask, or with
    a lender that never yields, the borrower computes on its own threads."""
    clock = FakeClock()
    lender = CoreLender(KEY, "decode-0", 1, str(tmp_path), deadline_s=0.1, yield_deadline_s=2.0,
                        clock=clock, sleep=clock.sleep)
    borrower = CoreBorrower(KEY, str(tmp_path), ask_wait_s=5.0)
    gate = LendGate(lender)
    gate.before_step()  # busy
    assert borrower.borrow() == 0 and not lender.asked()  # a decode-only step does not ask
    got: list[int] = []
    asking = threading.Thread(target=lambda: got.append(borrower.borrow(ask=True)))
    asking.start()
    wait_until(lender.asked, 5.0, "the prompt chunk's ask")
    assert lender.yields == 0
    gate.after_step(True)  # the step ends with more to run: yields to the asking chunk
    asking.join(5.0)
    assert got == [1] and borrower.got_by_asking and lender.yields == 1 and not lender.held
    assert not lender.asked()  # the borrower cleared its ask
    gate.before_step()  # the chunk still runs: the lender waits past deadline_s, up to yield_deadline_s
    assert not lender.held and lender.late == 1
    assert lender.wait_s == pytest.approx(2.0 + RETRY_S)
    borrower.give_back()
    gate.before_step()
    assert lender.held
    gate.after_step(True)  # nobody asks: it keeps its cores
    assert lender.held and lender.yields == 1
    assert gate.stats().yields == 1

    impatient = CoreBorrower(KEY, str(tmp_path), ask_wait_s=0.05)
    assert impatient.borrow(ask=True) == 0  # the lender never yields: its own threads after 0.05 s
    assert impatient.asks == 1 and impatient.ask_s >= 0.05 and not impatient.got_by_asking
    assert not lender.asked()
    gate.close()
    borrower.close()
    impatient.close()


def test_a_prefill_and_a_busy_decode_worker_take_both_cores_in_turn(tmp_path: Path) -> None:
    """A decode worker with work steps on the idle prefill worker's thread too; a prompt chunk that
    arrives asks, and runs on both threads once the decode step ends; the prefill worker, with more to
    compute, lends its own thread before giving the decode worker's back, so the next decode step runs
    on both again."""

    def gate(name: str, asks: bool) -> ShareGate:
        lender = CoreLender(KEY, name, 1, str(tmp_path))
        borrower = CoreBorrower(KEY, str(tmp_path), own=lender.path, ask_wait_s=5.0)
        share = ShareGate(LendGate(lender), BorrowGate(borrower, 1, lambda: True, lambda: asks))
        share.borrow.cpus = 2
        return share

    threads = torch.get_num_threads()
    prefill, decode = gate("prefill-0", asks=True), gate("decode-0", asks=False)
    try:
        decode.before_step()  # the prefill worker is idle: its thread too
        assert decode.borrow._extra == 1
        chunk = threading.Thread(target=prefill.before_step)
        chunk.start()  # asks, then waits for its own thread (borrowed) and the decode worker's
        wait_until(decode.lend.lender.asked, 5.0, "the prompt chunk's ask")
        decode.after_step(True)  # gives the prefill thread back, then yields its own
        chunk.join(5.0)
        assert not chunk.is_alive() and prefill.borrow._extra == 1 and prefill.lend.lender.held
        step = threading.Thread(target=decode.before_step)
        step.start()  # waits for the chunk
        prefill.after_step(True)  # more to compute: lends its own thread, then gives the decode one back
        step.join(5.0)
        assert not step.is_alive() and decode.lend.lender.held and decode.borrow._extra == 1
        assert not prefill.lend.lender.held
        decode.after_step(True)
        assert decode.stats().yields == 1 and decode.stats().reclaim_late == 0
        assert prefill.stats().asked_steps == 1 and prefill.stats().borrowed_steps == 1
    finally:
        torch.set_num_threads(threads)
        prefill.close()
        decode.close()


def test_only_a_long_thread_invariant_prompt_asks() -> None:
    """``step_gate``: a prompt chunk asks busy workers for their cores only while a prompt of at least
    ``ASK_MIN_TOKENS`` is left, and only where its chunks are thread-invariant."""
    left = [ASK_MIN_TOKENS - 1]
    deployment = f"test-{os.getpid()}"
    invariant = step_gate(deployment, "prefill-0", 1, lambda: False, True, lambda: left[0])
    torch_products = step_gate(deployment, "prefill-1", 1, lambda: False, False, lambda: left[0])
    try:
        for g in (invariant, torch_products):
            g.borrow.cpus = 2
        assert not invariant.borrow.will_ask()
        left[0] = ASK_MIN_TOKENS
        assert invariant.borrow.will_ask() and not torch_products.borrow.will_ask()
    finally:
        invariant.close()
        torch_products.close()


def test_native_prompt_chunks_are_the_same_on_any_thread_count(tiny_model_dir: Path) -> None:
    """What lets a prompt chunk run on borrowed threads (``LLMEngine.prompts_thread_invariant``): with the
    native products and attention a chunked prompt's K/V and first token are bitwise the same on one
    thread and on two; torch's products are not promised to be."""
    from engine import LLM, SamplingParams

    prompt = [1 + (i * 13) % 200 for i in range(300)]
    kv: list[torch.Tensor] = []
    first: list[list[int]] = []
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            engine = LLM(str(tiny_model_dir), num_threads=n, num_kv_blocks=40, max_num_batched_tokens=128,
                         enable_prefix_caching=False).engine
            assert engine.prompts_thread_invariant()
            r = engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0), hold_kv=True)
            assert engine.longest_prompt_left() == 300  # what decides whether a chunk asks (step_gate)
            engine.step()
            assert engine.longest_prompt_left() == 300 - 128
            while engine.has_unfinished():
                engine.step()
            kv.append(engine.runner.kv_cache[:, torch.tensor(engine.kv.blocks_of(r.request_id))].clone())
            first.append(r.output_token_ids)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(kv[0], kv[1]) and first[0] == first[1]
    plain = LLM(str(tiny_model_dir), linear_kernel="plain", num_kv_blocks=8).engine
    assert not plain.prompts_thread_invariant()

"""The engine alone in a closed loop: what a colocated worker's engine makes without Ray or HTTP.

``--concurrency`` requests of ``--input-len`` random token ids each, greedy, exactly
``--output-len`` new tokens; each finished request is replaced by a new one until
``--duration`` seconds have passed, then the loop drains. The engine is built and
stepped on one ``EngineThread`` with ``--threads`` torch threads, as a worker runs it
(``worker/base.py``), after a short untimed warm-up. Prints output tokens/s over the
whole loop and, from the steps' own clocks (``StepClock``), the mean decode-only step
and the prompt-carrying steps' time per prompt token: the figures ``/v1/workers``
gives for a served worker, so served and alone compare term by term.

    python -m bench.lab.closed_loop [--concurrency 16] [--duration 40] [--input-len 256]
        [--output-len 64] [--threads 2] [--json OUT]

Huge pages are on, as in the served workers (``bench/__init__.py``; ``THP_MEM_ALLOC_ENABLE=0``
turns them off).
"""

from __future__ import annotations

import argparse
import json
import random
import time

from engine.async_engine import EngineThread, StepClock
from engine.config import EngineConfig
from engine.llm import start_engine
from engine.sampling_params import SamplingParams


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--duration", type=float, default=40.0)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)

    thread = EngineThread(args.threads)
    engine, _ = thread.call(start_engine, args.model, EngineConfig())
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size

    def prompt() -> list[int]:
        return [rng.randrange(100, vocab) for _ in range(args.input_len)]

    def drain() -> None:
        while engine.has_unfinished():
            thread.call(engine.step)

    for _ in range(2):
        engine.add_request(prompt(), SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    drain()
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    clock = StepClock()
    t0 = time.perf_counter()
    for _ in range(args.concurrency):
        engine.add_request(prompt(), params)
    finished = 0
    while engine.has_unfinished():
        for out in thread.call(clock.timed, engine.step, lambda: engine.last_step_work):
            if out.finished:
                finished += 1
                if time.perf_counter() - t0 < args.duration:
                    engine.add_request(prompt(), params)
    elapsed = time.perf_counter() - t0
    thread.close()
    w = clock.work
    result = {
        "concurrency": args.concurrency, "threads": args.threads, "requests": finished,
        "seconds": round(elapsed, 2), "output_tok_s": round(finished * args.output_len / elapsed, 1),
        "decode_step_ms": round(w.decode_wall_s / max(w.decode_steps, 1) * 1e3, 1),
        "decode_batch": round(w.decode_rows / max(w.decode_steps, 1), 1),
        "prefill_ms_per_token": round(w.prefill_wall_s / max(w.prefill_tokens, 1) * 1e3, 3),
        "prefill_tokens_per_step": round(w.prefill_tokens / max(w.prefill_steps, 1)),
    }
    print(" ".join(f"{k} {v}" for k, v in result.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

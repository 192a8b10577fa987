"""What drawing a step's sampled rows costs: ``Sampler.sample`` against the exponential race it replaced.

Both take the same ``[rows, vocab]`` logits at temperature 1 (the OpenAI default a load client sends),
each row from its own seeded generator, and are timed in turn in one process, their order swapped every
repeat. The race (``argmax(p / q)`` with ``q ~ Exp(1)`` drawn per vocabulary entry from each row's
generator) is kept here only as the reference the draw is measured against.

    python -m bench.lab.sampling [--rows 1,16,64] [--vocab 49152] [--threads 2] [--repeats 30]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from functools import partial

import torch

from engine.sampling import Sampler, SamplingParams, SamplingState


def race(logits: torch.Tensor, states: list[SamplingState]) -> list[int]:
    """The exponential race over the softmax of ``logits``, one ``Exp(1)`` per entry."""
    probs = logits.softmax(dim=-1)
    q = torch.empty_like(probs)
    for j, state in enumerate(states):
        q[j].exponential_(generator=state.generator(logits.device))
    q.clamp_min_(torch.finfo(q.dtype).tiny)
    return (probs / q).argmax(dim=-1).tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,16,64")
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    sampler = Sampler()
    print(f"{args.threads} threads, vocab {args.vocab}, best and median of {args.repeats}, ms")
    print("| rows | race best | race median | draw best | draw median | race / draw (medians) |")
    print("|---:|---:|---:|---:|---:|---:|")
    for rows in map(int, args.rows.split(",")):
        logits = torch.randn(rows, args.vocab) * 3
        states = [SamplingState(SamplingParams(temperature=1.0, seed=i), [1]) for i in range(rows)]
        run: dict[str, Callable[[], object]] = {"race": partial(race, logits, states),
                                                "draw": partial(sampler.sample, logits, states)}
        times: dict[str, list[float]] = {name: [] for name in run}
        for rep in range(args.repeats + 1):
            for name in list(run) if rep % 2 == 0 else list(run)[::-1]:
                t0 = time.perf_counter()
                run[name]()
                if rep:  # the first round warms both up
                    times[name].append(time.perf_counter() - t0)
        cells = []
        for name in run:
            cells += [min(times[name]) * 1e3, statistics.median(times[name]) * 1e3]
        print(f"| {rows} | " + " | ".join(f"{c:.2f}" for c in cells) + f" | {cells[1] / cells[3]:.1f} |")


if __name__ == "__main__":
    main()

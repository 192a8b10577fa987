"""What a Ray stream item costs: one stream per request against one stream of per-step frames.

An async actor sends ``--requests`` requests' token batches, one batch per request
every ``--interval`` seconds (an engine step), ``--steps`` times: either as one Ray
streaming call per request (an item per request per step) or as one streaming call
whose items each carry every request's batch of a step (``decode/outbox.py``'s
frames). Prints the wall time and the CPU seconds of the actor's process and of the
caller's (the router's side), both runs twice, alternating.

    python -m bench.lab.ray_items [--requests 16] [--steps 400] [--interval 0.005]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import ray

from messages.wire import OutputFrame, StreamItem, TokenBatch


def _cpu() -> float:
    t = os.times()
    return t.user + t.system


@ray.remote
class Sender:
    async def per_request(self, rid: int, steps: int, interval: float) -> AsyncIterator[bytes]:
        for k in range(steps):
            await asyncio.sleep(interval)
            batch = TokenBatch(request_id=f"r{rid}", token_ids=[k], finished=k == steps - 1)
            yield msgspec.msgpack.encode(batch)

    async def frames(self, requests: int, steps: int, interval: float) -> AsyncIterator[bytes]:
        for k in range(steps):
            await asyncio.sleep(interval)
            yield msgspec.msgpack.encode(OutputFrame([
                StreamItem(i, TokenBatch(request_id=f"r{i}", token_ids=[k], finished=k == steps - 1))
                for i in range(requests)]))

    def cpu(self) -> float:
        return _cpu()


async def _consume(stream: Any) -> int:
    n = 0
    async for ref in stream:
        await ref
        n += 1
    return n


async def _run(sender: Any, mode: str, args: argparse.Namespace) -> str:
    a0, c0, w0 = await sender.cpu.remote(), _cpu(), time.perf_counter()
    if mode == "per request":
        streams = [sender.per_request.options(num_returns="streaming").remote(i, args.steps, args.interval)
                   for i in range(args.requests)]
        items = sum(await asyncio.gather(*[_consume(s) for s in streams]))
    else:
        items = await _consume(sender.frames.options(num_returns="streaming").remote(
            args.requests, args.steps, args.interval))
    wall, caller = time.perf_counter() - w0, _cpu() - c0
    actor = await sender.cpu.remote() - a0
    tokens = args.requests * args.steps
    return (f"{mode:12s} {items:6d} Ray items for {tokens} token batches: wall {wall:.2f} s, actor CPU "
            f"{actor:.2f} s, caller CPU {caller:.2f} s ({(actor + caller) / tokens * 1e3:.3f} ms a batch)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--interval", type=float, default=0.005)
    args = parser.parse_args(argv)
    ray.init(num_cpus=2, include_dashboard=False, logging_level=logging.ERROR)
    try:
        sender = Sender.remote()  # type: ignore[attr-defined]
        ray.get(sender.cpu.remote())
        for mode in ("per request", "frames", "per request", "frames"):
            print(asyncio.run(_run(sender, mode, args)), flush=True)
    finally:
        ray.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

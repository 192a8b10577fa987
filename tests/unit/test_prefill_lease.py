"""A prefill lease ended by the router (``release`` or ``abort`` of the request) ends at once: no lease is
left counted on the worker until its deadline, and none is reported as expired later.

Found by the chaos soak (``bench.chaos``): a client that disconnected after its prompt was prefilled had
its blocks freed by the router's release, but the lease stayed in the KV source until its deadline and
then counted as expired.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from engine.config import EngineConfig
from engine.sampling_params import SamplingParams
from messages.codec import pack, unpack
from messages.wire import GenerateRequest, PrefillResult, WorkerStats
from prefill.worker import PrefillWorker


def test_release_and_abort_end_the_lease(tiny_model_dir: Path) -> None:
    config = EngineConfig(num_kv_blocks=64, block_size=16)
    worker = PrefillWorker("prefill-t", str(tiny_model_dir), pack(config), lease_seconds=0.3)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

    async def main() -> list[WorkerStats]:
        seen = []
        for i, end in enumerate(("release", "abort")):
            req = GenerateRequest(request_id=f"r{i}", prompt_token_ids=list(range(1, 41)), sampling=params)
            result = unpack(await worker.prefill(pack(req)), PrefillResult)
            assert len(result.handle.block_ids) == 3
            seen.append(unpack(await worker.stats(), WorkerStats))
            await (worker.release(req.request_id) if end == "release" else worker.abort(req.request_id))
            seen.append(unpack(await worker.stats(), WorkerStats))
        await asyncio.sleep(0.6)  # past both deadlines; the poller has run many times
        seen.append(unpack(await worker.stats(), WorkerStats))
        await worker.aengine.stop()
        return seen

    held, released, held2, aborted, later = asyncio.run(main())
    assert (held.num_leases, held2.num_leases) == (1, 1)
    assert held.num_used_blocks == 3
    for s in (released, aborted, later):
        assert (s.num_leases, s.num_used_blocks, s.leases_expired) == (0, 0, 0)

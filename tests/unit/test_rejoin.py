"""A restarted prefill worker rejoins even when a decode worker dies during the handshake: the decode
worker's death is its own (found by the chaos soak: a decode worker killed while draining made the
router give up a restarting prefill worker for good). No Ray: the handles wrap plain objects whose
calls raise Ray's own exceptions (``tests/fakes.py``)."""

from __future__ import annotations

import asyncio

import pytest
from ray.exceptions import ActorDiedError

from messages.codec import pack
from messages.wire import ErrorKind, WorkerError
from router.client import PDClient
from router.errors import RequestFailed
from tests.fakes import FakeActor
from transfer.wire import AgentInfo, KvLayout

LAYOUT = KvLayout(model="m", dtype="float32", num_layers=2, num_blocks=8, block_size=16, num_kv_heads=1,
                  head_dim=8, element_size=4)


def agent(name: str) -> bytes:
    return pack(AgentInfo(wire_version=1, compat_hash="h", agent_name=name, metadata=b"", base_addr=0,
                          device_id=0, mem_type="DRAM", layout=LAYOUT))


def test_a_decode_worker_dying_in_the_handshake_does_not_fail_the_prefill_rejoin() -> None:
    async def run() -> None:
        dead = FakeActor(connect=ActorDiedError())
        alive = FakeActor(connect=b"")
        client = PDClient([FakeActor(ready=agent("prefill-0-new"))], [dead, alive])
        prefill = client.table.prefill[0]
        d_dead, d_alive = client.table.decode
        await client._rejoin(prefill)  # what the revival loop calls; raised ActorDiedError before
        assert prefill.agent is not None and prefill.agent.agent_name == "prefill-0-new"
        assert not d_dead.alive and d_alive.alive  # the dead one is out of routing, waiting for Ray
        assert dead.calls == alive.calls == ["connect"]
        await client.table.stop()

    asyncio.run(run())


def test_a_refused_handshake_still_fails_the_rejoin() -> None:
    async def run() -> None:
        refusal = pack(WorkerError(kind=ErrorKind.INVALID, message="incompatible KV layout"))
        client = PDClient([FakeActor(ready=agent("prefill-0-new"))], [FakeActor(connect=refusal)])
        with pytest.raises(RequestFailed, match="incompatible KV layout"):
            await client._rejoin(client.table.prefill[0])
        assert client.table.decode[0].alive
        await client.table.stop()

    asyncio.run(run())

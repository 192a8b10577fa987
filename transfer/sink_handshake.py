"""The sink's handshake with a source worker: check it, then add its agents and prepare its lists.

- ``plan_peers(layout, info, staging_bytes)`` checks before anything changes: every rank of the source
  group (``info`` is rank 0's, the others in ``tp_ranks``) for wire version and compatibility hash
  (``transfer/compat.py``: ``IncompatibleKvError`` names the field that differs), that the group holds
  every KV head this sink rank needs (``transfer/heads.py``), and that the staging buffer holds one
  block of every rank read from by staging (``ValueError`` otherwise). It answers the ranks to connect
  to: those holding this rank's heads, and rank 0, which the notifications go to.
- ``connect_peers`` adds each one's NIXL agent and connects to it; a rank whose heads equal this rank's
  also gets a remote descriptor list of all its regions (``transfer/descriptors.py``), prepared once:
  its reads go whole region into whole region by index. A rank holding other heads is read through
  the staging buffer (``Peer.staged``).
- ``disconnect_peers`` undoes it, best effort (the remote may already be gone).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from transfer.compat import check_compatible
from transfer.descriptors import region_table
from transfer.heads import HeadRun, head_reads, whole_rows
from transfer.staging import blocks_per_chunk
from transfer.wire import AgentInfo, KvLayout

if TYPE_CHECKING:
    from nixl._api import nixl_agent, nixl_prepped_dlist_handle

logger = logging.getLogger(__name__)


@dataclass
class Peer:
    """One rank of a source worker: the heads read from it, and once connected its NIXL name and (whole
    regions only) its prepared descriptor list."""

    info: AgentInfo
    runs: list[HeadRun]
    whole: bool  # its heads are exactly this rank's: whole regions into whole regions
    nixl_name: str = ""
    dlist: nixl_prepped_dlist_handle | None = field(default=None, repr=False)

    @property
    def staged(self) -> bool:
        return bool(self.runs) and not self.whole


@dataclass
class Remote:
    """A connected source worker."""

    info: AgentInfo  # the source worker's rank 0 (its other ranks in ``tp_ranks``)
    peers: list[Peer]  # peers[0] is rank 0: notifications go there

    @property
    def nixl_name(self) -> str:
        return self.peers[0].nixl_name

    @property
    def staged(self) -> bool:
        return any(peer.staged for peer in self.peers)


def plan_peers(layout: KvLayout, info: AgentInfo, staging_bytes: int) -> list[Peer]:
    """The source ranks this sink rank connects to, checked (see the module docstring)."""
    group = info.group
    for rank in group:
        check_compatible(layout, rank)
    runs = head_reads(layout, [rank.layout for rank in group])
    peers: list[Peer] = []
    for index, rank in enumerate(group):
        mine = [run for run in runs if run.source == index]
        if not mine and index > 0:
            continue
        whole = len(mine) == 1 and whole_rows(mine[0], layout, rank.layout)
        if mine and not whole:
            blocks_per_chunk(rank.layout, staging_bytes)  # a buffer too small fails here
        peers.append(Peer(rank, mine, whole))
    return peers


def connect_peers(agent: nixl_agent, backend: str, peers: list[Peer]) -> None:
    """Add each peer's agent, prepare the list of a whole-region peer, connect."""
    for peer in peers:
        nixl_name = agent.add_remote_agent(peer.info.metadata)
        peer.nixl_name = nixl_name.decode() if isinstance(nixl_name, bytes) else nixl_name
        if peer.whole:
            rank = peer.info
            table = region_table(rank.base_addr, rank.layout, rank.device_id, rank.scales_addr)
            peer.dlist = agent.prep_xfer_dlist(peer.nixl_name, table, rank.mem_type, backends=[backend])
        agent.make_connection(peer.nixl_name, backends=[backend])


def disconnect_peers(agent: nixl_agent, peers: list[Peer]) -> None:
    """Release each peer's list and remove its agent; failures are logged, not raised."""
    for peer in peers:
        try:
            if peer.dlist is not None:
                peer.dlist.release()
            agent.remove_remote_agent(peer.nixl_name)
        except Exception:  # noqa: BLE001 - the remote may already be gone
            logger.exception("disconnecting from %s failed", peer.info.agent_name)

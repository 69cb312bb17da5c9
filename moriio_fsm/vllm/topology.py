"""Ranks and ports: which peer ranks a rank exchanges KV with, and where each one listens.

Rules: an instance's ports are bases; rank ``r`` of data-parallel rank ``d`` with ``t`` TP
ranks listens at ``base + d * t + r`` (upstream MoRIIO's arithmetic, so mixed deployments
agree). Heads are split by TP rank, so the ranks that pair up, and which slice of a peer
rank's heads a rank fills, follow from the two TP sizes.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..layout import HeadSlice
from .params import PeerAddress

#: (host, port) of a peer rank's socket.
Endpoint = tuple[str, int]


def peer_ranks(my_rank: int, my_tp: int, peer_tp: int) -> list[int]:
    """The peer TP ranks that exchange KV with ``my_rank``.

    With more peer ranks than ours each of ours pairs with a group of them; with fewer,
    several of ours share one.
    """
    if peer_tp >= my_tp:
        group = peer_tp // my_tp
        return list(range(my_rank * group, (my_rank + 1) * group))
    return [my_rank * peer_tp // my_tp]


def rank_port(base: int, dp_rank: int, tp_size: int, tp_rank: int) -> int:
    """The port of TP rank ``tp_rank`` of data-parallel rank ``dp_rank``, from the
    instance's base port."""
    return base + dp_rank * tp_size + tp_rank


def notify_endpoint(peer: PeerAddress, peer_rank: int) -> Endpoint:
    """Where rank ``peer_rank`` of ``peer`` takes control messages."""
    return peer.host, rank_port(peer.notify_port, peer.dp_rank, peer.tp_size, peer_rank)


def handshake_endpoint(peer: PeerAddress, peer_rank: int) -> Endpoint:
    """Where rank ``peer_rank`` of ``peer`` answers handshakes."""
    return peer.host, rank_port(peer.handshake_port, peer.dp_rank, peer.tp_size, peer_rank)


@dataclass(frozen=True)
class Topology:
    """This rank's place: its TP rank and size and its data-parallel rank."""

    tp_rank: int
    tp_size: int
    dp_rank: int

    def peer_ranks(self, peer: PeerAddress) -> list[int]:
        """The ranks of ``peer`` this rank exchanges KV with."""
        return peer_ranks(self.tp_rank, self.tp_size, peer.tp_size)

    def first_peer_rank(self, peer: PeerAddress) -> int:
        """The rank of ``peer`` this rank shakes hands with and reads from."""
        return self.peer_ranks(peer)[0]

    def writers_into_peer(self, peer: PeerAddress | None) -> int:
        """P, WRITE: how many P ranks (this one included) write into each rank of ``peer``."""
        return max(1, self.tp_size // (peer.tp_size if peer else 1))

    def head_slice(self, peer: PeerAddress | None) -> HeadSlice | None:
        """P, WRITE: which slice of a ``peer`` rank's heads this rank writes, when the peer
        has k times fewer ranks (so k times our heads per rank); None for whole blocks."""
        if peer is None:
            return None
        return HeadSlice.of_rank(self.tp_rank, self.tp_size, peer.tp_size)

    def own_port(self, base: int) -> int:
        """This rank's port from its instance's base port."""
        return rank_port(base, self.dp_rank, self.tp_size, self.tp_rank)

    def label(self, engine_id: str) -> str:
        """This rank's name in engine keys and traces."""
        return f"{engine_id}-dp{self.dp_rank}-tp{self.tp_rank}"

"""The handshake between ranks of different TP sizes: which head counts a link accepts.

A P rank of a TP size k times D's holds 1/k of a D rank's heads: its head-sliced link must
accept exactly k times its heads and nothing else, and a link without a slice (READ mode, or
equal TP sizes) must refuse unequal heads per rank, saying which TP sizes work.
"""

from __future__ import annotations

import concurrent.futures

import pytest

from moriio_fsm.adapters.zmq import AgentMetadata, HandshakeReply
from moriio_fsm.layout import HeadSlice, KVCacheSummary
from moriio_fsm.vllm.params import PeerAddress
from moriio_fsm.vllm.peers import PeerLinks, PeerMismatchError
from moriio_fsm.vllm.topology import Topology

LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]


def summary(heads: int | None, layout: str = "cpu_attn") -> KVCacheSummary:
    return KVCacheSummary(
        layout=layout,
        axis_order="NL" if layout == "mla" else "HND",
        dtype="bfloat16",
        block_size=128,
        kernel_block_size=128,
        num_kv_heads=heads,
        head_size=32,
    )


class Engine:
    """Just enough of a transfer engine for a link to register the peer."""

    def register_remote_engine(self, desc):
        pass

    def unpack_engine_desc(self, packed):
        return packed

    def unpack_memory_desc(self, packed):
        return packed

    def prepare_remote_memory(self, desc):
        pass


def links_to(peer: KVCacheSummary, mine: KVCacheSummary) -> PeerLinks:
    reply = HandshakeReply(
        AgentMetadata("D", b"agent", (0, 0), 64, 4096, "CPU_ATTN", peer.to_wire()),
        {name: (b"memory",) for name in LAYERS},
    )

    def request(address):
        answered: concurrent.futures.Future = concurrent.futures.Future()
        answered.set_result(reply)
        return answered

    return PeerLinks(request, Engine(), mine, LAYERS)


def test_a_head_sliced_link_to_a_rank_with_twice_the_heads_is_made_and_keeps_its_slice():
    link = links_to(summary(2), summary(1)).link(("127.0.0.1", 1), HeadSlice(2, 1))
    assert link.result(5).heads == HeadSlice(2, 1)
    assert link.result(5).num_blocks == 64


@pytest.mark.parametrize("peer_heads", [1, 4])
def test_a_head_sliced_link_refuses_any_other_head_count(peer_heads):
    link = links_to(summary(peer_heads), summary(1)).link(("127.0.0.1", 1), HeadSlice(2, 0))
    with pytest.raises(
        PeerMismatchError, match=r"num_kv_heads: local 1, remote .*expected remote 2"
    ):
        link.result(5)


def test_a_link_without_a_slice_refuses_unequal_heads_naming_the_tp_rule():
    # D at TP 1 (2 heads) reading P at TP 2 (1 head per rank): READ reads whole blocks.
    link = links_to(summary(1), summary(2)).link(("127.0.0.1", 1))
    with pytest.raises(PeerMismatchError) as refused:
        link.result(5)
    assert "num_kv_heads: local 2, remote 1" in str(refused.value)
    assert "READ mode reads one P rank's whole blocks" in str(refused.value)


def test_the_same_address_with_and_without_a_slice_are_two_links():
    links = links_to(summary(2), summary(1))
    sliced = links.link(("127.0.0.1", 1), HeadSlice(2, 0))
    assert sliced.result(5).heads == HeadSlice(2, 0)
    with pytest.raises(PeerMismatchError):
        links.link(("127.0.0.1", 1)).result(5)
    assert links.link(("127.0.0.1", 1), HeadSlice(2, 0)) is sliced  # cached


def test_an_mla_peer_is_refused_a_head_slice():
    mla = summary(None, layout="mla")
    link = links_to(mla, mla).link(("127.0.0.1", 1), HeadSlice(2, 0))
    with pytest.raises(PeerMismatchError, match="an MLA cache has none"):
        link.result(5)


@pytest.mark.parametrize(
    ("rank", "size", "peer_size", "slice_"),
    [
        (0, 2, 1, HeadSlice(2, 0)),
        (1, 2, 1, HeadSlice(2, 1)),
        (3, 4, 2, HeadSlice(2, 1)),
        (0, 1, 1, None),
        (0, 1, 2, None),  # D larger than P: no slice, so the handshake refuses unequal heads
    ],
)
def test_each_p_rank_asks_for_its_own_slice(rank, size, peer_size, slice_):
    peer = PeerAddress("127.0.0.1", 1, 2, tp_size=peer_size)
    assert Topology(rank, size, 0).head_slice(peer) == slice_

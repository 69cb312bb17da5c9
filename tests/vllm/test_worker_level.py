"""The worker half across two processes, for every KV cache layout: every block's bytes land.

P and D are separate processes that each allocate their own cache (the same-host engine
writes and reads straight into memory the other process owns), talk over real ZeroMQ
sockets and handshake as two vLLM workers would. D's blocks (other ids than P's) must
hold exactly P's bytes after a WRITE transfer and after a READ transfer, and each side
must report its request to vLLM exactly once. With P at TP 2 (two processes, one head
each) and D at TP 1, each P rank's heads must land in its half of D's heads, and D's load
is done only once both wrote.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
from harness import free_port

pytestmark = pytest.mark.integration

PEER = os.path.join(os.path.dirname(__file__), "worker_peer.py")
LAYOUTS = [
    "separated_nhd",
    "separated_hnd",
    "interleaved_nhd",
    "interleaved_hnd",
    "mla",
    "cpu_attn",
]
P_BLOCKS, D_BLOCKS = [1, 3, 4, 7], [9, 2, 10, 5]


class Peer:
    def __init__(self):
        self.process = subprocess.Popen(
            [sys.executable, PEER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert self.read() == {"ready": True}

    def read(self):
        line = self.process.stdout.readline()
        assert line, "the worker peer process exited"
        return json.loads(line)

    def ask(self, **command):
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()
        reply = self.read()
        assert "error" not in reply, reply["error"]
        return reply

    def stop(self):
        try:
            self.process.stdin.write(json.dumps({"op": "quit"}) + "\n")
            self.process.stdin.close()
            self.process.wait(20)
        finally:
            if self.process.poll() is None:
                self.process.kill()
                self.process.wait()


@pytest.fixture(scope="module")
def peers():
    prefill, decode = Peer(), Peer()
    yield prefill, decode
    prefill.stop()
    decode.stop()


def address(ports):
    return {"host": "127.0.0.1", "notify_port": ports[0], "handshake_port": ports[1]}


@pytest.mark.parametrize("mode", ["write", "read"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_block_lands_in_the_other_process(peers, layout, mode):
    prefill, decode = peers
    name = f"{layout}-{mode}"
    p_ports, d_ports = (free_port(), free_port()), (free_port(), free_port())
    prefill.ask(
        op="open",
        name=name,
        side="send",
        mode=mode,
        layout=layout,
        notify=p_ports[0],
        handshake=p_ports[1],
    )
    decode.ask(
        op="open",
        name=name,
        side="receive",
        mode=mode,
        layout=layout,
        notify=d_ports[0],
        handshake=d_ports[1],
    )
    tid = f"tx-{name}"
    try:
        if mode == "write":
            decode.ask(
                op="receive", name=name, req="d-1", tid=tid, blocks=D_BLOCKS, peer=address(p_ports)
            )
            prefill.ask(
                op="send", name=name, req="p-1", tid=tid, blocks=P_BLOCKS, peer=address(d_ports)
            )
            prefill.ask(op="end", name=name, req="p-1", tid=tid, awaits=True, peer=address(d_ports))
        else:
            prefill.ask(op="end", name=name, req="p-1", tid=tid, awaits=True, blocks=P_BLOCKS)
            decode.ask(
                op="receive",
                name=name,
                req="d-1",
                tid=tid,
                blocks=D_BLOCKS,
                peer=address(p_ports),
                remote_blocks=P_BLOCKS,
            )
        d_told = decode.ask(op="poll", name=name, wait_s=15)
        p_told = prefill.ask(op="poll", name=name, wait_s=15)
        assert d_told == {"sending": [], "recving": ["d-1"], "load_errors": []}
        assert p_told == {"sending": ["p-1"], "recving": [], "load_errors": []}
        assert decode.ask(op="digest", name=name, blocks=D_BLOCKS) == prefill.ask(
            op="digest", name=name, blocks=P_BLOCKS
        )
        # No byte landed outside D's blocks.
        assert decode.ask(op="pristine", name=name, blocks=D_BLOCKS) == {"pristine": True}
        # Reported once: nothing more arrives.
        assert decode.ask(op="poll", name=name, wait_s=0.3)["recving"] == []
    finally:
        prefill.ask(op="close", name=name)
        decode.ask(op="close", name=name)


def free_port_pair() -> int:
    """A base port whose next port is free too: a TP 2 instance's rank 1 listens at base + 1."""
    for _ in range(50):
        base = free_port()
        try:
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", base + 1))
        except OSError:
            continue
        return base
    raise RuntimeError("no two consecutive free ports on 127.0.0.1")


@pytest.fixture
def second_prefill():
    peer = Peer()
    yield peer
    peer.stop()


@pytest.mark.parametrize("layout", [name for name in LAYOUTS if name != "mla"])
def test_two_p_ranks_write_their_heads_into_one_d_rank(peers, second_prefill, layout):
    """P TP 2 (one head per rank, two processes) -> D TP 1 (two heads): D's load is done only
    when both ranks' heads landed, each in its own half of D's blocks."""
    prefill, decode = peers
    ranks = (prefill, second_prefill)
    name = f"{layout}-tp2"
    p_notify, p_handshake = free_port_pair(), free_port_pair()
    d_ports = (free_port(), free_port())
    for rank, process in enumerate(ranks):
        process.ask(
            op="open",
            name=name,
            side="send",
            mode="write",
            layout=layout,
            notify=p_notify,
            handshake=p_handshake,
            tp=[rank, 2],
            heads=1,
        )
    decode.ask(
        op="open",
        name=name,
        side="receive",
        mode="write",
        layout=layout,
        notify=d_ports[0],
        handshake=d_ports[1],
    )
    tid, p_address = f"tx-{name}", dict(address((p_notify, p_handshake)), tp_size=2)
    try:
        decode.ask(op="receive", name=name, req="d-1", tid=tid, blocks=D_BLOCKS, peer=p_address)
        for rank, process in enumerate(ranks):
            process.ask(
                op="send", name=name, req="p-1", tid=tid, blocks=P_BLOCKS, peer=address(d_ports)
            )
            process.ask(op="end", name=name, req="p-1", tid=tid, awaits=True, peer=address(d_ports))
            assert process.ask(op="poll", name=name, wait_s=15)["sending"] == ["p-1"]
            if rank == 0:
                # One writer of two finished: D's load is not done yet.
                assert decode.ask(op="poll", name=name, wait_s=0.3)["recving"] == []
        assert decode.ask(op="poll", name=name, wait_s=15) == {
            "sending": [],
            "recving": ["d-1"],
            "load_errors": [],
        }
        for rank, process in enumerate(ranks):
            assert decode.ask(
                op="digest", name=name, blocks=D_BLOCKS, heads=[rank, 1]
            ) == process.ask(op="digest", name=name, blocks=P_BLOCKS), f"P rank {rank}'s heads"
        assert decode.ask(op="pristine", name=name, blocks=D_BLOCKS) == {"pristine": True}
    finally:
        for process in (*ranks, decode):
            process.ask(op="close", name=name)


def test_read_mode_refuses_a_p_rank_holding_other_heads(peers):
    """D TP 1 cannot read from P TP 2: D reads one P rank's whole blocks, so the handshake
    refuses P's one head against D's two and the load fails at once, D's blocks untouched."""
    prefill, decode = peers
    name, layout = "cpu_attn-read-tp2", "cpu_attn"
    p_notify, p_handshake = free_port_pair(), free_port_pair()
    d_ports = (free_port(), free_port())
    prefill.ask(
        op="open",
        name=name,
        side="send",
        mode="read",
        layout=layout,
        notify=p_notify,
        handshake=p_handshake,
        tp=[0, 2],
        heads=1,
    )
    decode.ask(
        op="open",
        name=name,
        side="receive",
        mode="read",
        layout=layout,
        notify=d_ports[0],
        handshake=d_ports[1],
    )
    tid = f"tx-{name}"
    try:
        prefill.ask(op="end", name=name, req="p-1", tid=tid, awaits=True, blocks=P_BLOCKS)
        decode.ask(
            op="receive",
            name=name,
            req="d-1",
            tid=tid,
            blocks=D_BLOCKS,
            peer=dict(address((p_notify, p_handshake)), tp_size=2),
            remote_blocks=P_BLOCKS,
        )
        told = decode.ask(op="poll", name=name, wait_s=15)
        assert told["recving"] == ["d-1"]
        assert sorted(told["load_errors"]) == sorted(D_BLOCKS)
        assert decode.ask(op="pristine", name=name, blocks=[]) == {"pristine": True}
    finally:
        prefill.ask(op="close", name=name)
        decode.ask(op="close", name=name)


def test_a_d_told_of_fewer_p_ranks_fails_the_load_instead_of_loading_some_heads(peers):
    """D's request named no remote_tp_size (one P rank) but P runs at TP 2: P rank 0 writes
    its head and says two ranks write. D cannot know its other head landed, so the load
    fails (vLLM recomputes) instead of completing with half of D's heads never written."""
    prefill, decode = peers
    name, layout = "cpu_attn-tp-unnamed", "cpu_attn"
    p_notify, p_handshake = free_port_pair(), free_port_pair()
    d_ports = (free_port(), free_port())
    prefill.ask(
        op="open",
        name=name,
        side="send",
        mode="write",
        layout=layout,
        notify=p_notify,
        handshake=p_handshake,
        tp=[0, 2],
        heads=1,
    )
    decode.ask(
        op="open",
        name=name,
        side="receive",
        mode="write",
        layout=layout,
        notify=d_ports[0],
        handshake=d_ports[1],
    )
    tid = f"tx-{name}"
    try:
        decode.ask(
            op="receive",
            name=name,
            req="d-1",
            tid=tid,
            blocks=D_BLOCKS,
            peer=address((p_notify, p_handshake)),
        )
        prefill.ask(
            op="send", name=name, req="p-1", tid=tid, blocks=P_BLOCKS, peer=address(d_ports)
        )
        prefill.ask(op="end", name=name, req="p-1", tid=tid, awaits=True, peer=address(d_ports))
        told = decode.ask(op="poll", name=name, wait_s=15)
        assert told["recving"] == ["d-1"]
        assert sorted(told["load_errors"]) == sorted(D_BLOCKS)
    finally:
        prefill.ask(op="close", name=name)
        decode.ask(op="close", name=name)

"""MoriEngine across real processes through the pinned wheel's Python layer over the stand-in: bytes both ways
between tensors each process allocated itself, peers that die or stop, and hostile traffic at the stand-in NIC.

The peer starts no transfer while this process writes or reads its tensor; what it reports is what landed there.
Kills and reaps use each peer's pid; every wait is bounded.
"""

import os
import signal
import socket
import struct

import pytest
import torch

from moriio_fsm.engines import MoriEngine, StatusCode

from ..json_peer import JsonLinePeer

# The byte checks are the NIXL process tests' own, run here against this module's peer and prefill.
from ..nixl.test_nixl_processes import (  # noqa: F401
    test_batch_read_pulls_the_bytes_the_peer_holds,
    test_bytes_written_here_land_in_the_tensor_the_peer_allocated,
    test_large_batches_of_many_ranges_move_every_byte,
    test_the_peer_reads_and_writes_this_processs_memory,
    wait_until_stopped,
)

PEER_SCRIPT = os.path.join(os.path.dirname(__file__), "..", "engine_peer.py")
REGION = 1 << 20
WAIT_MS = 20_000

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def peer():
    started = JsonLinePeer(PEER_SCRIPT, "mori", "mori-decode", str(REGION))
    yield started
    started.stop()


def attach(engine: MoriEngine, peer: JsonLinePeer, source: torch.Tensor):
    engine.register_remote_engine(engine.unpack_engine_desc(bytes.fromhex(peer.hello["engine"])))
    local = engine.register_torch_tensor(source)
    remote = engine.unpack_memory_desc(bytes.fromhex(peer.hello["memory"]))
    session = engine.create_session(local, remote)
    assert session is not None
    return session, local


@pytest.fixture
def prefill(standin, peer):
    engine = MoriEngine("mori-prefill", "127.0.0.1", 0)
    source = torch.randint(
        0, 256, (REGION,), dtype=torch.uint8, generator=torch.Generator().manual_seed(5)
    )
    session, local = attach(engine, peer, source)
    yield engine, session, source, local
    standin.drain()
    engine.close()


@pytest.fixture
def doomed(standin, monkeypatch):
    """A fresh peer the test may kill, stop or make forget its region, and this process's engine attached."""
    monkeypatch.setenv("MORI_STANDIN_REPLY_TIMEOUT_S", "2")
    decode = JsonLinePeer(PEER_SCRIPT, "mori", "mori-doomed", str(REGION))
    engine = MoriEngine("mori-doomed-prefill", "127.0.0.1", 0)
    try:
        session, _ = attach(engine, decode, torch.ones(REGION, dtype=torch.uint8))
        warm = session.write(0, 0, 64, session.allocate_transfer_uid())
        assert warm.wait_for(WAIT_MS) and warm.succeeded(), warm.message()
        yield decode, engine, session
    finally:
        try:
            os.kill(decode.pid, signal.SIGCONT)  # a stopped peer must be able to die
        except ProcessLookupError:
            pass
        decode.stop()
        standin.drain()
        engine.close()


@pytest.mark.parametrize("op", ["write", "read"])
def test_a_peer_killed_mid_transfer_fails_what_it_did_not_answer_and_is_reported_gone(doomed, op):
    decode, engine, session = doomed
    post = session.batch_write if op == "write" else session.batch_read
    chunk = 64 << 10
    ranges = ([i * chunk for i in range(16)], [i * chunk for i in range(16)], [chunk] * 16)
    statuses = [post(*ranges, session.allocate_transfer_uid()) for _ in range(20)]
    decode.stop()
    statuses += [post(*ranges, session.allocate_transfer_uid()) for _ in range(10)]
    for status in statuses:
        status.wait_for(WAIT_MS)  # returns once mori settled the status
    assert all(s.native_code() in (StatusCode.SUCCESS, StatusCode.ERR_RDMA_OP) for s in statuses)
    last = statuses[-1]
    assert last.native_code() == StatusCode.ERR_RDMA_OP, (
        "a transfer posted after the peer died succeeded"
    )
    assert "does not answer" in last.message() or "flushed" in last.message()
    # MoriEngine never calls such a failure final (mori may still be writing): the machines time it out.
    assert not last.is_final() and last.writes_may_continue()
    assert not session.alive(), "mori's peer-failure record did not reach the session"


def test_a_stopped_peer_fails_the_transfer_after_the_retry_budget_not_never(doomed):
    decode, _, session = doomed
    os.kill(decode.pid, signal.SIGSTOP)
    wait_until_stopped(decode.pid)
    status = session.batch_write([0], [0], [4096], session.allocate_transfer_uid())
    status.wait_for(WAIT_MS)
    assert status.native_code() == StatusCode.ERR_RDMA_OP, "a write to a stopped peer never ended"
    assert "does not answer" in status.message()


def test_a_region_the_peer_deregistered_is_never_written(doomed):
    decode, _, session = doomed
    assert decode.ask(op="forget")["ok"]
    status = session.batch_write([0], [128], [64], session.allocate_transfer_uid())
    status.wait_for(WAIT_MS)
    assert status.native_code() == StatusCode.ERR_RDMA_OP and "not registered" in status.message()
    assert decode.dump(128, 64) == bytes(64), "bytes landed in memory the peer had deregistered"


class TestHostileTrafficAtTheNic:
    """Anyone who reaches the engine's port: the listener drops what breaks the protocol and touches nothing
    outside a registered region, and real transfers go on."""

    def nic(self, peer) -> socket.socket:
        desc = peer_engine_address(peer)
        return socket.create_connection(desc, timeout=5)

    def test_garbage_drops_only_that_connection(self, peer, prefill):
        with self.nic(peer) as rogue:
            rogue.sendall(b"GET / HTTP/1.1\r\n\r\n" + os.urandom(200))
            assert rogue.recv(64) == b"", "the NIC answered a frame that broke its protocol"
        assert_a_write_lands(peer, prefill)

    def test_a_forged_frame_naming_memory_outside_the_region_is_refused(self, peer, prefill):
        from moriio_fsm.engines.mori_standin.wire import (
            OP_WRITE,
            Request,
            read_reply,
            request_bytes,
        )

        before = peer.dump(0, 64)
        hostile = [
            ("a region id that is not registered", dict(mem_id=999, ranges=[(0, 8)])),
            ("a range past the region", dict(ranges=[(REGION - 4, 8)])),
            ("a region address of the forger's choosing", dict(address=0x1000, ranges=[(0, 8)])),
        ]
        region = peer_region(peer)
        for what, change in hostile:
            fields = dict(
                op=OP_WRITE, notify=False, uid=0, target_key="mori-decode", initiator_key="rogue",
                mem_id=region["id"], address=region["data"], size=region["size"], ranges=[(0, 8)],
            )  # fmt: skip
            fields.update(change)
            request = Request(**fields)
            with self.nic(peer) as rogue:
                rogue.sendall(b"".join(request_bytes(request, b"\xee" * request.payload_size)))
                reply = read_reply(rogue)
            assert reply.code == StatusCode.ERR_RDMA_OP, what
        assert peer.dump(0, 64) == before
        assert b"\xee" not in peer.dump(REGION - 64, 64)

    def test_a_frame_claiming_a_huge_batch_is_dropped_before_memory_is_taken(self, peer, prefill):
        header = struct.pack("!4sBB2xQIQQIHH", b"MSQ1", 1, 0, 0, 0, 0, 0, 1 << 31, 0, 0)
        with self.nic(peer) as rogue:
            rogue.sendall(header)
            assert rogue.recv(64) == b""
        assert_a_write_lands(peer, prefill)


def assert_a_write_lands(peer, prefill) -> None:
    _, session, source, _ = prefill
    status = session.batch_write([8192], [700_000], [4096], session.allocate_transfer_uid())
    assert status.wait_for(WAIT_MS) and status.succeeded(), status.message()
    assert peer.dump(700_000, 4096) == source[8192 : 8192 + 4096].numpy().tobytes()


def peer_engine_address(peer) -> tuple[str, int]:
    import msgpack

    fields = msgpack.unpackb(bytes.fromhex(peer.hello["engine"]))
    return fields[3], fields[4]


def peer_region(peer) -> dict:
    import msgpack

    fields = msgpack.unpackb(bytes.fromhex(peer.hello["memory"]))
    return {"id": fields[1], "data": fields[4], "size": fields[5]}


def test_a_silent_connection_is_dropped_so_it_cannot_hold_a_slot(standin, mori_io, monkeypatch):
    from moriio_fsm.engines.mori_standin import nic

    monkeypatch.setattr(nic, "IDLE_S", 0.3)
    engine = mori_io.IOEngine("idle-target", mori_io.IOEngineConfig("127.0.0.1", 0))
    engine.create_backend(mori_io.BackendType.RDMA)
    desc = engine.get_engine_desc()
    with socket.create_connection((desc.host, desc.port), timeout=10) as silent:
        assert silent.recv(1) == b"", "the NIC kept a connection that never spoke"

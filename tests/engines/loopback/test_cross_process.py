"""Two real processes: this one writes and reads, a peer process owns the memory.

The peer runs no transfer code while we write; the bytes it reports back are
what landed in its own tensor. Every peer is killed and reaped by its fixture.
"""

import os

import pytest
import torch

from moriio_fsm.engines import LoopbackEngine, StatusCode

from ..json_peer import JsonLinePeer

PEER_SCRIPT = os.path.join(os.path.dirname(__file__), "peer_process.py")
REGION = 1 << 16
WAIT_MS = 10_000

pytestmark = pytest.mark.timeout(120)


class Peer(JsonLinePeer):
    def __init__(self, key: str):
        super().__init__(PEER_SCRIPT, str(REGION), key)
        self.engine_desc = bytes.fromhex(self.hello["engine"])
        self.shared_mem = bytes.fromhex(self.hello["shared"])
        self.private_mem = bytes.fromhex(self.hello["private"])


@pytest.fixture(scope="module")
def peer():
    started = Peer("cross-decode")
    yield started
    started.stop()


@pytest.fixture
def producer(peer):
    with LoopbackEngine("cross-prefill") as engine:
        engine.register_remote_engine(engine.unpack_engine_desc(peer.engine_desc))
        source = torch.randint(
            0, 256, (REGION,), dtype=torch.uint8, generator=torch.Generator().manual_seed(4)
        )
        engine.source = source
        engine.source_mem = engine.register_torch_tensor(source)
        yield engine


def test_bytes_written_here_land_in_the_peer_process(peer, producer):
    remote = producer.unpack_memory_desc(peer.shared_mem)
    session = producer.create_session(producer.source_mem, remote)
    assert session is not None and session.alive()
    chunk = 4096
    local_offsets = [i * chunk for i in range(8)]
    remote_offsets = [(7 - i) * chunk + 8 * chunk for i in range(8)]
    status = session.batch_write(
        local_offsets, remote_offsets, [chunk] * 8, session.allocate_transfer_uid()
    )
    assert status.wait_for(WAIT_MS) and status.succeeded(), status.message()
    for lo, ro in zip(local_offsets, remote_offsets):
        assert peer.dump(ro, chunk) == bytes(producer.source[lo : lo + chunk].tolist())
    assert peer.dump(0, 8 * chunk) == bytes(8 * chunk)


def test_batch_read_pulls_bytes_the_peer_holds(peer, producer):
    pattern = bytes(range(200)) * 5
    assert peer.ask(op="fill", offset=50_000, hex=pattern.hex())["ok"]
    remote = producer.unpack_memory_desc(peer.shared_mem)
    session = producer.create_session(producer.source_mem, remote)
    status = session.batch_read(
        [0, 2000], [50_000, 50_500], [500, 500], session.allocate_transfer_uid()
    )
    assert status.wait_for(WAIT_MS) and status.succeeded(), status.message()
    assert bytes(producer.source[0:500].tolist()) == pattern[:500]
    assert bytes(producer.source[2000:2500].tolist()) == pattern[500:]


def test_private_memory_of_another_process_is_unreachable(peer, producer):
    remote = producer.unpack_memory_desc(peer.private_mem)
    assert not remote.shared
    assert producer.create_session(producer.source_mem, remote) is None


def test_transfers_to_a_dead_peer_fail_with_an_rdma_error():
    peer = Peer("doomed-decode")
    try:
        with LoopbackEngine("orphaned-prefill") as engine:
            engine.register_remote_engine(engine.unpack_engine_desc(peer.engine_desc))
            source = torch.ones(REGION, dtype=torch.uint8)
            session = engine.create_session(
                engine.register_torch_tensor(source), engine.unpack_memory_desc(peer.shared_mem)
            )
            first = session.write(0, 0, 64, session.allocate_transfer_uid())
            assert first.wait_for(WAIT_MS) and first.succeeded()
            peer.stop()
            assert not session.alive()
            after = session.write(0, 0, 64, session.allocate_transfer_uid())
            assert after.wait_for(WAIT_MS)
            assert after.code() == StatusCode.ERR_RDMA_OP and "gone" in after.message()
    finally:
        peer.stop()


def test_a_dead_peers_mapping_is_released_while_the_engine_is_open(region_leak_check):
    peer = Peer("vanishing-decode")
    check = region_leak_check()
    try:
        with LoopbackEngine("surviving-prefill") as engine:
            engine.register_remote_engine(engine.unpack_engine_desc(peer.engine_desc))
            source = torch.ones(REGION, dtype=torch.uint8)
            session = engine.create_session(
                engine.register_torch_tensor(source), engine.unpack_memory_desc(peer.shared_mem)
            )
            status = session.write(0, 0, 64, session.allocate_transfer_uid())
            assert status.wait_for(WAIT_MS) and status.succeeded()
            assert check.leaked(), "the peer's region should be mapped here"
            peer.stop()
            assert not session.alive()
            del session, status
            assert check.leaked() == []
    finally:
        peer.stop()

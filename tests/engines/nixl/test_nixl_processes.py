"""NixlEngine across real processes, over UCX TCP and over shared memory: bytes both ways, and peers that die or stop.

The peer allocates its own tensor and starts no transfer while this process writes or reads it; the bytes it
reports are what landed there. Kills and reaps use each peer's pid; every wait is bounded.
"""

import os
import signal
import time

import pytest
import torch

from moriio_fsm.engines import StatusCode
from moriio_fsm.engines.nixl import probe_nixl

from ..json_peer import JsonLinePeer

PEER_SCRIPT = os.path.join(os.path.dirname(__file__), "..", "engine_peer.py")
REGION = 1 << 20
WAIT_MS = 20_000

_availability = probe_nixl()
pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.skipif(
        not _availability.available, reason=f"NixlEngine not tested: {_availability.reason}"
    ),
]

# UCX_TLS for both processes: TCP alone (the target's engine thread must progress UCX for
# bytes to land), and with shared memory (UCX moves bytes by cross-memory attach).
TRANSPORTS = {"tcp": "tcp,self", "shared_memory": "tcp,self,sm"}


def engine(key: str, **options):
    from moriio_fsm.engines.nixl import NixlEngine

    return NixlEngine(key, "127.0.0.1", **options)


@pytest.fixture(params=sorted(TRANSPORTS), scope="module")
def transport(request):
    return request.param


@pytest.fixture(scope="module")
def peer(transport):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("UCX_TLS", TRANSPORTS[transport])  # the peer inherits it
        started = JsonLinePeer(PEER_SCRIPT, "nixl", f"nixl-decode-{transport}", str(REGION))
        yield started
        started.stop()


@pytest.fixture
def prefill(peer, transport, monkeypatch):
    """This process's engine, attached to the module's peer, with a registered source tensor."""
    monkeypatch.setenv("UCX_TLS", TRANSPORTS[transport])
    with engine(f"nixl-prefill-{transport}") as prefill_engine:
        prefill_engine.register_remote_engine(
            prefill_engine.unpack_engine_desc(bytes.fromhex(peer.hello["engine"]))
        )
        source = torch.randint(
            0, 256, (REGION,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3)
        )
        local = prefill_engine.register_torch_tensor(source)
        remote = prefill_engine.unpack_memory_desc(bytes.fromhex(peer.hello["memory"]))
        session = prefill_engine.create_session(local, remote)
        assert session is not None and session.alive()
        yield prefill_engine, session, source, local


def test_bytes_written_here_land_in_the_tensor_the_peer_allocated(peer, prefill):
    _, session, source, _ = prefill
    chunk = 4096
    local = [i * chunk for i in range(16)]
    remote = [(15 - i) * chunk + 64 * chunk for i in range(16)]
    status = session.batch_write(local, remote, [chunk] * 16, session.allocate_transfer_uid())
    assert status.wait_for(WAIT_MS) and status.succeeded(), status.message()
    for lo, ro in zip(local, remote):
        assert peer.dump(ro, chunk) == source[lo : lo + chunk].numpy().tobytes()
    assert peer.dump(0, 64 * chunk) == bytes(64 * chunk)


def test_batch_read_pulls_the_bytes_the_peer_holds(peer, prefill):
    _, session, source, _ = prefill
    pattern = bytes(range(256)) * 8
    assert peer.ask(op="fill", offset=300_000, hex=pattern.hex())["ok"]
    status = session.batch_read(
        [0, 5000], [300_000, 301_024], [1024, 1024], session.allocate_transfer_uid()
    )
    assert status.wait_for(WAIT_MS) and status.succeeded(), status.message()
    assert source[0:1024].numpy().tobytes() == pattern[:1024]
    assert source[5000:6024].numpy().tobytes() == pattern[1024:]


def test_the_peer_reads_and_writes_this_processs_memory(peer, prefill):
    """The other direction: the peer initiates, this process's engine only progresses UCX."""
    prefill_engine, _, source, local = prefill
    me = dict(engine=prefill_engine.get_engine_desc().pack().hex(), memory=local.pack().hex())
    answer = peer.ask(
        op="pull", local_offsets=[500_000], remote_offsets=[1234], sizes=[70_000], **me
    )
    assert answer["code"] == StatusCode.SUCCESS, answer["message"]
    assert peer.dump(500_000, 70_000) == source[1234:71_234].numpy().tobytes()
    expected = peer.dump(600_000, 3000)
    answer = peer.ask(op="push", local_offsets=[600_000], remote_offsets=[10], sizes=[3000], **me)
    assert answer["code"] == StatusCode.SUCCESS, answer["message"]
    assert source[10:3010].numpy().tobytes() == expected


def test_large_batches_of_many_ranges_move_every_byte(peer, prefill):
    _, session, source, _ = prefill
    count, chunk = 2048, 256  # more ranges than one iovec call or UCX fragment takes
    local = [i * chunk for i in range(count)]
    remote = [((i * 7) % count) * chunk for i in range(count)]
    status = session.batch_write(local, remote, [chunk] * count, session.allocate_transfer_uid())
    assert status.wait_for(WAIT_MS) and status.succeeded(), status.message()
    landed = peer.dump(0, REGION)
    for i in (0, 1, count // 2, count - 1):
        assert (
            landed[remote[i] : remote[i] + chunk]
            == source[local[i] : local[i] + chunk].numpy().tobytes()
        )


@pytest.fixture
def doomed(transport, monkeypatch):
    """A fresh peer the test may kill or stop, and this process's engine attached to it."""
    monkeypatch.setenv("UCX_TLS", TRANSPORTS[transport])
    decode = JsonLinePeer(PEER_SCRIPT, "nixl", f"nixl-doomed-{transport}", str(REGION))
    try:
        with engine(f"nixl-doomed-prefill-{transport}", transfer_timeout_s=3.0) as prefill_engine:
            prefill_engine.register_remote_engine(
                prefill_engine.unpack_engine_desc(bytes.fromhex(decode.hello["engine"]))
            )
            source = torch.ones(REGION, dtype=torch.uint8)
            session = prefill_engine.create_session(
                prefill_engine.register_torch_tensor(source),
                prefill_engine.unpack_memory_desc(bytes.fromhex(decode.hello["memory"])),
            )
            assert session is not None
            warm = session.write(
                0, 0, 64, session.allocate_transfer_uid()
            )  # connect before the test
            assert warm.wait_for(WAIT_MS) and warm.succeeded(), warm.message()
            yield decode, prefill_engine, session
    finally:
        try:
            os.kill(decode.pid, signal.SIGCONT)  # a stopped peer must be able to die
        except ProcessLookupError:
            pass
        decode.stop()


def wait_until_stopped(pid: int, timeout_s: float = 10.0) -> None:
    """Until every thread of ``pid`` is stopped: SIGSTOP is delivered, not obeyed, when kill returns."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        states = set()
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/stat") as stat:
                    states.add(stat.read().rsplit(")", 1)[1].split()[0])
            except FileNotFoundError:
                continue
        if states <= {"T", "t"}:
            return
        time.sleep(0.01)
    raise AssertionError(f"process {pid} did not stop within {timeout_s} s")


@pytest.mark.parametrize("op", ["write", "read"])
def test_a_peer_killed_mid_transfer_leaves_every_status_final_and_failed_after(doomed, op):
    decode, prefill_engine, session = doomed
    post = session.batch_write if op == "write" else session.batch_read
    chunk = 64 << 10
    ranges = ([i * chunk for i in range(16)], [i * chunk for i in range(16)], [chunk] * 16)
    statuses = [post(*ranges, session.allocate_transfer_uid()) for _ in range(40)]
    decode.stop()
    statuses += [post(*ranges, session.allocate_transfer_uid()) for _ in range(20)]
    assert prefill_engine.wait_all(statuses, WAIT_MS), "a transfer to a dead peer never completed"
    assert all(s.succeeded() or s.code() == StatusCode.ERR_RDMA_OP for s in statuses), [
        s for s in statuses if not s.succeeded()
    ][:3]
    assert statuses[-1].failed(), "a transfer posted after the peer died succeeded"
    late = session.write(0, 0, 64, session.allocate_transfer_uid())
    assert late.wait_for(WAIT_MS) and late.code() == StatusCode.ERR_RDMA_OP
    assert not session.alive()
    assert prefill_engine.create_session(session.local_mem, session.remote_mem) is None


def test_a_stopped_peer_ends_in_a_cancelled_transfer_not_a_hang(doomed, transport):
    """Over TCP nothing lands while the peer is stopped, and the engine's transfer timeout ends the status;
    over shared memory the initiator usually moves the bytes itself (the write then succeeds into the
    stopped process), but UCX may pick a protocol that needs the peer's progress: then the timeout
    ends it the same way. Either way the status ends; it never hangs."""
    decode, prefill_engine, session = doomed
    os.kill(decode.pid, signal.SIGSTOP)
    wait_until_stopped(decode.pid)
    status = session.write(0, 0, REGION, session.allocate_transfer_uid())
    assert status.wait_for(WAIT_MS), "a transfer to a stopped peer never ended"
    if transport == "tcp" or not status.succeeded():
        assert status.code() == StatusCode.ERR_RDMA_OP and "cancelled" in status.message(), (
            status.message()
        )
        os.kill(decode.pid, signal.SIGCONT)
        return
    os.kill(decode.pid, signal.SIGCONT)
    assert decode.dump(REGION - 4096, 4096) == bytes([1]) * 4096

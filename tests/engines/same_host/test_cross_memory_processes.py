"""CrossMemoryEngine across real processes: the peer allocates its own tensor, as vLLM allocates its KV cache.

The peer runs no transfer code while this process writes or reads its memory; the bytes it reports are what
landed in its tensor. Kills and reaps use each peer's pid; every wait is bounded.
"""

import os
import time

import pytest
import torch

from moriio_fsm.engines import StatusCode
from moriio_fsm.engines.same_host import CrossMemoryEngine, iovec
from moriio_fsm.layout import LayerKVFormat, describe_layer, plan_transfer

from ..json_peer import JsonLinePeer

PEER_SCRIPT = os.path.join(os.path.dirname(__file__), "cross_memory_peer.py")
REGION = 1 << 20
WAIT_MS = 10_000

pytestmark = pytest.mark.timeout(180)


def owner(key: str, *extra: str) -> JsonLinePeer:
    return JsonLinePeer(PEER_SCRIPT, "owner", key, str(REGION), *extra)


# kernel: every copy is a process_vm_writev/readv; shared: both engines share their
# tensors' pages, and each copies into the other's mapped pages by memcpy.
@pytest.fixture(scope="module", params=["kernel", "shared"])
def peer(request):
    started = owner("cma-decode", *(["share"] if request.param == "shared" else []))
    started.shared = request.param == "shared"
    assert started.hello["shares_pages"] is started.shared
    yield started
    started.stop()


@pytest.fixture
def prefill(peer):
    """This process's engine, attached to the module's peer, with a registered source tensor."""
    with CrossMemoryEngine("cma-prefill", share_pages=peer.shared) as engine:
        engine.register_remote_engine(
            engine.unpack_engine_desc(bytes.fromhex(peer.hello["engine"]))
        )
        source = torch.randint(
            0, 256, (REGION,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3)
        )
        local = engine.register_torch_tensor(source)
        remote = engine.unpack_memory_desc(bytes.fromhex(peer.hello["memory"]))
        session = engine.create_session(local, remote)
        assert session is not None and session.alive()
        # Shared: the peer's pages are mapped here, so this process copies into them itself.
        assert (session.mapped_remote_address is not None) is peer.shared
        assert local.shares_pages is peer.shared
        yield engine, session, source, local


def no_kernel(*call):
    raise AssertionError("a copy into shared pages went to the kernel")


def test_bytes_written_here_land_in_the_tensor_the_peer_allocated(peer, prefill, monkeypatch):
    _, session, source, _ = prefill
    if peer.shared:  # every range lies inside the shared pages: memory copies only
        monkeypatch.setitem(iovec.SYSCALLS, "write", no_kernel)
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


def test_the_peer_reads_this_processs_memory_into_its_own(peer, prefill):
    engine, _, source, local = prefill
    answer = peer.ask(
        op="pull",
        engine=engine.get_engine_desc().pack().hex(),
        memory=local.pack().hex(),
        local_offsets=[500_000],
        remote_offsets=[1234],
        sizes=[70_000],
    )
    assert answer["code"] == StatusCode.SUCCESS, answer["message"]
    assert peer.dump(500_000, 70_000) == source[1234:71_234].numpy().tobytes()


@pytest.mark.parametrize("shared", [False, True], ids=["kernel", "shared"])
def test_a_cpu_attention_layer_planned_here_lands_block_by_block_in_the_peers_cache(shared):
    """P plans one layer of the CPU backend's cache and writes it; D's blocks hold P's blocks' bytes."""
    heads, block_size, head_size = 2, 32, 16
    decode = owner(
        "cma-kv-decode", f"12,{heads},{block_size},{head_size}", *(["share"] if shared else [])
    )
    try:
        with CrossMemoryEngine("cma-kv-prefill") as engine:
            engine.register_remote_engine(
                engine.unpack_engine_desc(bytes.fromhex(decode.hello["engine"]))
            )
            cache = torch.randn(
                8, heads, block_size, 2 * head_size, generator=torch.Generator().manual_seed(5)
            )
            cache = cache.to(torch.float16)
            kv_format = LayerKVFormat(
                block_size=block_size,
                num_kv_heads=heads,
                head_size=head_size,
                attention_backend="CPU_ATTN",
            )
            local_ids, remote_ids = [1, 2, 3, 7], [10, 11, 0, 5]
            plan = plan_transfer(
                describe_layer("layers.0", cache, kv_format), local_ids, remote_ids, 12
            )
            session = engine.create_session(
                engine.register_torch_tensor(cache),
                engine.unpack_memory_desc(bytes.fromhex(decode.hello["memory"])),
            )
            status = session.batch_write(*plan.lists, session.allocate_transfer_uid())
            assert status.wait_for(WAIT_MS) and status.succeeded(), status.message()
            block_bytes = cache[0].numel() * cache.element_size()
            for local_id, remote_id in zip(local_ids, remote_ids):
                assert (
                    decode.dump(remote_id * block_bytes, block_bytes)
                    == cache[local_id].numpy().tobytes()
                )
            assert decode.dump(block_bytes, block_bytes) == bytes(
                block_bytes
            )  # block 1 was not written
    finally:
        decode.stop()


def attached(decode: JsonLinePeer, key: str):
    engine = CrossMemoryEngine(key)
    engine.register_remote_engine(engine.unpack_engine_desc(bytes.fromhex(decode.hello["engine"])))
    source = torch.ones(REGION, dtype=torch.uint8)
    session = engine.create_session(
        engine.register_torch_tensor(source),
        engine.unpack_memory_desc(bytes.fromhex(decode.hello["memory"])),
    )
    return engine, session


@pytest.fixture(params=["kernel", "shared"])
def doomed(request):
    """A fresh peer that the test may deregister or kill, and this process's engine attached to it."""
    decode = owner("cma-doomed-decode", *(["share"] if request.param == "shared" else []))
    try:
        engine, session = attached(decode, "cma-doomed-prefill")
        assert (session.mapped_remote_address is not None) is (request.param == "shared")
        with engine:
            yield decode, engine, session
    finally:
        decode.stop()


def test_transfers_into_memory_the_peer_deregistered_fail_and_move_nothing(doomed):
    decode, _, session = doomed
    assert decode.ask(op="deregister")["ok"]
    assert not session.alive()
    status = session.write(0, 0, 4096, session.allocate_transfer_uid())
    assert status.wait_for(WAIT_MS) and status.code() == StatusCode.ERR_RDMA_OP
    assert "deregistered" in status.message()
    assert decode.dump(0, 4096) == bytes(4096)


@pytest.mark.parametrize("doomed", ["kernel"], indirect=True)  # it stops the kernel's copy midway
def test_a_peer_killed_between_two_calls_of_one_batch_ends_it_failed(doomed, monkeypatch):
    """The kernel itself answers ESRCH for the second IOV_MAX chunk: the peer died mid-batch."""
    decode, _, session = doomed
    real, calls = iovec.SYSCALLS["write"], []

    def kill_before_the_second_call(pid, local_iov, remote_iov, count):
        calls.append(count)
        if len(calls) == 2:
            decode.stop()
        return real(pid, local_iov, remote_iov, count)

    monkeypatch.setitem(iovec.SYSCALLS, "write", kill_before_the_second_call)
    count = iovec.IOV_MAX + 100
    status = session.batch_write(
        [i * 64 for i in range(count)],
        [i * 128 for i in range(count)],
        [64] * count,
        session.allocate_transfer_uid(),
    )
    assert status.wait_for(WAIT_MS)
    assert status.code() == StatusCode.ERR_RDMA_OP and "gone" in status.message(), status.message()
    assert len(calls) == 2


def test_a_peer_killed_while_transfers_stream_leaves_every_status_final(doomed):
    decode, engine, session = doomed
    statuses = [
        session.write(0, (n % 16) * 65536, 65536, session.allocate_transfer_uid())
        for n in range(50)
    ]
    decode.stop()
    statuses += [session.write(0, 0, 65536, session.allocate_transfer_uid()) for _ in range(50)]
    assert engine.wait_all(statuses, WAIT_MS), "a transfer to a dead peer never completed"
    assert all(s.succeeded() or s.code() == StatusCode.ERR_RDMA_OP for s in statuses)
    assert statuses[-1].code() == StatusCode.ERR_RDMA_OP and "gone" in statuses[-1].message()
    assert not session.alive()
    assert engine.create_session(session.local_mem, session.remote_mem) is None


def test_a_dead_peers_shared_pages_are_let_go_without_any_transfer_to_it():
    decode = owner("cma-dying-decode", "share")
    try:
        engine, session = attached(decode, "cma-dying-prefill")
        with engine:
            token = session.remote_mem.shared_token
            assert session.mapped_remote_address is not None
            del session
            decode.stop()
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and mapped_here(token):
                time.sleep(0.1)
            assert not mapped_here(token), "a dead peer's pages stayed mapped"
    finally:
        decode.stop()


def mapped_here(token: str) -> bool:
    with open("/proc/self/maps") as maps:
        return any(token in line for line in maps)


def test_a_held_transfer_released_after_the_peer_died_fails(doomed):
    decode, engine, session = doomed
    hold = engine.faults.hold_nth(1)
    queued = session.write(0, 0, 4096, session.allocate_transfer_uid())
    decode.stop()
    hold.release()
    assert queued.wait_for(WAIT_MS) and queued.code() == StatusCode.ERR_RDMA_OP
    assert "gone" in queued.message()


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="dropping to another uid needs root")


def intrude(target: CrossMemoryEngine, memory, when: str) -> dict:
    """Run a peer that drops to uid 65534 and tries to write into ``target``'s memory."""
    intruder = JsonLinePeer(
        PEER_SCRIPT, "intruder", target.get_engine_desc().pack().hex(), memory.pack().hex(), when
    )
    try:
        return intruder.hello
    finally:
        intruder.stop()


@needs_root
def test_a_process_without_ptrace_permission_cannot_attach_and_is_told_why():
    with CrossMemoryEngine("cma-guarded") as engine:
        memory = engine.register_torch_tensor(torch.zeros(4096, dtype=torch.uint8))
        answer = intrude(engine, memory, "before_attach")
    assert answer["errno"] == 1, answer  # EPERM, from the kernel itself
    for needed in (
        "EPERM",
        "ptrace permission",
        "uid 65534",
        "uid 0",
        "CAP_SYS_PTRACE",
        "ptrace_scope",
    ):
        assert needed in answer["attach_error"], answer["attach_error"]


@needs_root
def test_a_writer_that_loses_ptrace_permission_gets_a_failed_status_saying_why():
    with CrossMemoryEngine("cma-guarded-later") as engine:
        target = torch.zeros(4096, dtype=torch.uint8)
        memory = engine.register_torch_tensor(target)
        answer = intrude(engine, memory, "after_attach")
        assert answer["code"] == StatusCode.ERR_RDMA_OP, answer
        assert "EPERM" in answer["message"] and "CAP_SYS_PTRACE" in answer["message"], answer[
            "message"
        ]
        assert int(target.count_nonzero()) == 0

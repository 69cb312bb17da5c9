"""Status semantics and fault injection of the engines that share LoopbackFaults (loopback, cross-memory), in one process.

Tests taking ``faulty_pair`` run once per such engine; the others are LoopbackEngine's own.
No test here depends on timing: a transfer is kept in progress by holding it
(``faults.hold_nth``) until the test releases it, and every wait is bounded.
"""

import gc
import threading

import pytest
import torch

from moriio_fsm.engines import LoopbackEngine, StatusCode
from moriio_fsm.engines.status import LocalTransferStatus

WAIT_MS = 10_000


def write_block(pair, index, size=256):
    offset = index * size
    return pair.session.batch_write(
        [offset], [offset], [size], pair.session.allocate_transfer_uid()
    )


def landed(pair, index, size=256):
    offset = index * size
    return torch.equal(pair.target[offset : offset + size], pair.source[offset : offset + size])


def test_status_is_in_progress_until_the_held_transfer_is_released_then_succeeds(faulty_pair):
    hold = faulty_pair.producer.faults.hold_nth(1)
    status = write_block(faulty_pair, 0)
    assert status.in_progress() and not status.succeeded() and not status.failed()
    assert hold.held == 1 and not landed(faulty_pair, 0)
    assert hold.release() == 1
    assert status.wait_for(WAIT_MS)
    assert status.succeeded() and landed(faulty_pair, 0)
    assert hold.released and hold.held == 0 and hold.release() == 0


def test_a_predicate_holds_every_match_until_release_and_none_after(faulty_pair):
    faults = faulty_pair.producer.faults
    hold = faults.hold_when(lambda posted: posted.total_bytes == 128)
    held = [write_block(faulty_pair, i, size=128) for i in range(3)]
    free = write_block(faulty_pair, 1)
    assert free.wait_for(WAIT_MS) and free.succeeded()
    assert hold.held == 3 and all(s.in_progress() for s in held)
    hold.release()
    assert faulty_pair.producer.wait_all(held, WAIT_MS) and all(s.succeeded() for s in held)
    later = write_block(faulty_pair, 5, size=128)
    assert later.wait_for(WAIT_MS) and later.succeeded() and hold.held == 0


def test_a_held_transfer_that_is_doomed_fails_when_released(faulty_pair):
    faults = faulty_pair.producer.faults
    faults.fail_nth(1, message="link flap")
    hold = faults.hold_nth(1)
    status = write_block(faulty_pair, 0)
    assert status.in_progress()
    hold.release()
    assert status.wait_for(WAIT_MS) and status.code() == StatusCode.ERR_RDMA_OP
    assert "link flap" in status.message() and not landed(faulty_pair, 0)


def test_a_held_transfer_fails_when_the_engine_closes_and_release_after_is_harmless(faulty_pair):
    hold = faulty_pair.producer.faults.hold_nth(1)
    status = write_block(faulty_pair, 0)
    faulty_pair.producer.close()
    assert status.code() == StatusCode.ERR_BAD_STATE and "closed" in status.message()
    assert hold.release() == 1
    assert status.code() == StatusCode.ERR_BAD_STATE


def test_a_hold_released_before_any_post_holds_nothing(faulty_pair):
    hold = faulty_pair.producer.faults.hold_nth(1)
    assert hold.release() == 0
    status = write_block(faulty_pair, 0)
    assert status.wait_for(WAIT_MS) and status.succeeded() and hold.held == 0


def test_predicates_may_call_back_into_the_engine_and_its_faults(faulty_pair):
    engine, session = faulty_pair.producer, faulty_pair.session
    seen = []

    def predicate(posted):
        seen.append((engine.allocate_transfer_uid(), session.alive()))
        engine.faults.fail_nth(1000)  # adding a rule from inside a predicate
        return False

    engine.faults.fail_when(predicate)
    outcome = []
    poster = threading.Thread(
        target=lambda: outcome.append(write_block(faulty_pair, 0)),
        name="predicate-poster",
        daemon=True,
    )
    poster.start()
    poster.join(WAIT_MS / 1000)
    assert not poster.is_alive(), "a predicate calling back into the engine deadlocked the post"
    assert outcome[0].wait_for(WAIT_MS) and outcome[0].succeeded()
    assert seen and seen[0][1] is True


def test_jittered_completions_all_succeed(faulty_pair):
    faulty_pair.producer.faults.set_latency(0.001, jitter_s=0.02, seed=7)
    statuses = [write_block(faulty_pair, i) for i in range(16)]
    assert faulty_pair.producer.wait_all(statuses, WAIT_MS)
    assert all(s.succeeded() for s in statuses)
    assert torch.equal(faulty_pair.target, faulty_pair.source)


def test_the_nth_transfer_fails_with_an_rdma_error_and_moves_no_bytes(faulty_pair):
    faulty_pair.producer.faults.fail_nth(2)
    statuses = [write_block(faulty_pair, i) for i in range(3)]
    assert faulty_pair.producer.wait_all(statuses, WAIT_MS)
    assert [s.code() for s in statuses] == [
        StatusCode.SUCCESS,
        StatusCode.ERR_RDMA_OP,
        StatusCode.SUCCESS,
    ]
    assert "#2" in statuses[1].message()
    assert landed(faulty_pair, 0) and landed(faulty_pair, 2)
    assert int(faulty_pair.target[256:512].count_nonzero()) == 0


def test_a_dropped_transfer_reports_success_and_moves_no_bytes(faulty_pair):
    faulty_pair.producer.faults.drop_nth(2)
    statuses = [write_block(faulty_pair, i) for i in range(3)]
    assert faulty_pair.producer.wait_all(statuses, WAIT_MS)
    assert all(s.succeeded() for s in statuses)  # the engine lies
    assert landed(faulty_pair, 0) and landed(faulty_pair, 2)
    assert int(faulty_pair.target[256:512].count_nonzero()) == 0


def test_drop_when_drops_every_match(faulty_pair):
    faulty_pair.producer.faults.drop_when(lambda posted: True)
    statuses = [write_block(faulty_pair, i) for i in range(2)]
    assert faulty_pair.producer.wait_all(statuses, WAIT_MS)
    assert all(s.succeeded() for s in statuses)
    assert int(faulty_pair.target.count_nonzero()) == 0


def test_a_predicate_chooses_which_transfers_fail(faulty_pair):
    doomed = faulty_pair.session.allocate_transfer_uid()
    faulty_pair.producer.faults.fail_when(
        lambda posted: posted.transfer_uid == doomed,
        code=StatusCode.ERR_GPU_OP,
        message="device lost",
    )
    bad = faulty_pair.session.batch_write([0], [0], [64], doomed)
    good = write_block(faulty_pair, 1)
    assert bad.wait_for(WAIT_MS) and good.wait_for(WAIT_MS)
    assert bad.code() == StatusCode.ERR_GPU_OP and "device lost" in bad.message()
    assert good.succeeded()


def test_an_injected_failure_must_use_an_error_code():
    with LoopbackEngine("codes") as engine:
        with pytest.raises(ValueError, match="above 10"):
            engine.faults.fail_nth(1, code=StatusCode.SUCCESS)
        with pytest.raises(ValueError, match="positive"):
            engine.faults.fail_nth(0)


def test_a_stalled_transfer_never_completes_and_fails_when_the_engine_closes(faulty_pair):
    faulty_pair.producer.faults.stall_nth(1)
    stalled = write_block(faulty_pair, 0)
    after = write_block(faulty_pair, 1)
    assert after.wait_for(WAIT_MS) and after.succeeded()
    assert not stalled.wait_for(200)
    assert stalled.in_progress()
    assert not landed(faulty_pair, 0)
    faulty_pair.producer.close()
    assert stalled.failed() and stalled.code() == StatusCode.ERR_BAD_STATE


def test_a_killed_session_fails_its_transfers_but_not_other_sessions(faulty_pair):
    other = faulty_pair.producer.create_session(faulty_pair.source_mem, faulty_pair.remote_mem)
    faulty_pair.session.kill()
    assert not faulty_pair.session.alive() and other.alive()
    dead = write_block(faulty_pair, 0)
    alive = other.batch_write([0], [0], [64], other.allocate_transfer_uid())
    assert dead.wait_for(WAIT_MS) and alive.wait_for(WAIT_MS)
    assert dead.code() == StatusCode.ERR_RDMA_OP and "killed" in dead.message()
    assert alive.succeeded()


def _sessions_on_reused_addresses(engine, mems):
    """Kills sessions and creates new ones until some new one sits where a killed one sat.

    CPython hands freed memory to new objects of the same size, but a cycle or another
    thread's allocation can delay that for a round, so this tries a few rounds."""
    for _ in range(20):
        killed = [engine.create_session(*mems) for _ in range(100)]
        for session in killed:
            session.kill()
        killed_addresses = {id(session) for session in killed}
        del killed, session
        gc.collect()
        later = [engine.create_session(*mems) for _ in range(100)]
        if killed_addresses & {id(s) for s in later}:
            return later
    raise AssertionError("no address was reused in 20 rounds; the test would prove nothing")


def test_a_killed_session_does_not_doom_a_later_one_at_the_same_address(faulty_pair):
    engine, mems = faulty_pair.producer, (faulty_pair.source_mem, faulty_pair.remote_mem)
    later = _sessions_on_reused_addresses(engine, mems)
    assert all(s.alive() for s in later)
    status = later[0].batch_write([0], [0], [64], engine.allocate_transfer_uid())
    assert status.wait_for(WAIT_MS) and status.succeeded()


def test_a_killed_peer_fails_every_session_to_it(faulty_pair):
    hold = faulty_pair.producer.faults.hold_nth(1)
    queued = write_block(faulty_pair, 0)
    faulty_pair.producer.faults.kill_peer(faulty_pair.consumer.key)
    assert not faulty_pair.session.alive()
    hold.release()
    assert queued.wait_for(WAIT_MS) and queued.code() == StatusCode.ERR_RDMA_OP
    assert "unreachable" in queued.message()
    assert not landed(faulty_pair, 0)


def test_writes_into_deregistered_memory_fail(faulty_pair):
    faulty_pair.consumer.deregister_memory(faulty_pair.target_mem)
    status = write_block(faulty_pair, 0)
    assert status.wait_for(WAIT_MS) and status.code() == StatusCode.ERR_RDMA_OP
    assert "deregistered" in status.message()


def test_posting_after_close_returns_a_failed_status():
    engine = LoopbackEngine("closing")
    tensor = torch.zeros(64, dtype=torch.uint8)
    mem = engine.register_torch_tensor(tensor)
    session = engine.create_session(mem, mem)
    engine.close()
    engine.close()  # idempotent
    status = session.batch_write([0], [32], [8], 1)
    assert status.code() == StatusCode.ERR_BAD_STATE and "closed" in status.message()
    assert not session.alive()


def test_first_final_code_wins():
    status = LocalTransferStatus()
    assert status.init()
    status.mark_in_progress()
    assert status.in_progress()
    assert status.settle(StatusCode.ERR_RDMA_OP, "first")
    assert not status.settle(StatusCode.SUCCESS)
    assert not status.settle(StatusCode.ERR_BAD_STATE, "second")
    status.mark_in_progress()
    assert status.code() == StatusCode.ERR_RDMA_OP and status.message() == "first"
    with pytest.raises(ValueError, match="not final"):
        LocalTransferStatus().settle(StatusCode.IN_PROGRESS)


def test_duplicate_live_engine_keys_are_refused():
    with LoopbackEngine("twin"):
        with pytest.raises(ValueError, match="twin"):
            LoopbackEngine("twin")
    LoopbackEngine("twin").close()  # the key is free again after close


def test_malformed_descriptors_are_refused_with_a_clear_error():
    with LoopbackEngine("parser") as engine:
        with pytest.raises(TypeError, match="bytes"):
            engine.unpack_engine_desc("not bytes")
        with pytest.raises(ValueError, match="engine descriptor"):
            engine.unpack_engine_desc(b"\xc1garbage")
        with pytest.raises(ValueError, match="memory"):
            engine.unpack_memory_desc(engine.get_engine_desc().pack())


def test_only_host_tensors_with_bytes_can_be_registered():
    with LoopbackEngine("shapes") as engine:
        with pytest.raises(ValueError, match="empty"):
            engine.register_torch_tensor(torch.zeros(0))
        with pytest.raises(TypeError, match="torch.Tensor"):
            engine.register_torch_tensor(b"1234")


def test_a_shared_tensor_keeps_its_dtype_and_shape():
    with LoopbackEngine("typed") as engine:
        tensor = engine.allocate_shared_tensor((2, 3, 4), torch.bfloat16)
        assert tensor.shape == (2, 3, 4) and tensor.dtype == torch.bfloat16
        mem = engine.register_torch_tensor(tensor[1])
        assert mem.shared and mem.size == 24 and mem.region_offset == 24
        assert mem.dtype == "bfloat16" and mem.shape == (3, 4)


def test_the_faults_answer_the_engine_through_decide_alone():
    from moriio_fsm.engines.faults import NO_FAULT, InjectedFailure, LoopbackFaults, PostedTransfer

    faults = LoopbackFaults()
    posted = [PostedTransfer(n, "write", n, "peer", 1, 8) for n in (1, 2, 3)]
    assert faults.decide(posted[0]) is NO_FAULT
    faults.fail_nth(2, message="flap")
    hold = faults.hold_when(lambda p: p.sequence == 3)
    assert faults.decide(posted[1]).failure == InjectedFailure(StatusCode.ERR_RDMA_OP, "flap")
    assert faults.decide(posted[1]).failure is None  # fail_nth is used up by its match
    verdict = faults.decide(posted[2])
    assert verdict.hold is hold and verdict.failure is None and not verdict.stall
    resumed = []
    assert hold.keep(lambda: resumed.append(3)) and hold.held == 1
    assert hold.release() == 1 and resumed == [3]
    assert not hold.keep(lambda: resumed.append(4))  # released: the engine runs it at once
    assert faults.decide(posted[2]) is NO_FAULT and resumed == [3]

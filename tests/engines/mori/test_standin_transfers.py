"""The stand-in moves real bytes through mori's own Python layer, asynchronously, with mori's codes, checks and
failure modes: what MoriEngine and vLLM's connector meet on real hardware.

Rules: no test waits on wall-clock time to see an order of events; a held transfer (a gate) shows what is true
before completion, and the transfer thread's order (one thread, first in first out) shows what is true after one.
"""

import gc

import pytest
import torch

WAIT_MS = 10_000


def settle_after(pair):
    """Wait until everything handed to the transfer thread before now has completed (it goes in order)."""
    probe = pair.write([0], [pair.target.numel() - 1], [1])
    assert probe.WaitFor(WAIT_MS) == pair.io.StatusCode.SUCCESS


def test_bytes_land_asynchronously_and_only_on_completion(standin, raw_pair):
    gate = standin.FAULTS.hold()
    status = raw_pair.write([0, 100], [500, 10], [64, 32])
    assert status.InProgress() and int(raw_pair.target.count_nonzero()) == 0
    gate.open()
    assert status.WaitFor(WAIT_MS) == raw_pair.io.StatusCode.SUCCESS
    assert torch.equal(raw_pair.target[500:564], raw_pair.source[0:64])
    assert torch.equal(raw_pair.target[10:42], raw_pair.source[100:132])
    assert int(raw_pair.target.count_nonzero()) == 96


def test_a_read_pulls_remote_bytes(raw_pair):
    raw_pair.target[:] = 7
    status = raw_pair.session.batch_read([10], [20], [30], raw_pair.session.allocate_transfer_uid())
    assert status.WaitFor(WAIT_MS) == raw_pair.io.StatusCode.SUCCESS
    assert raw_pair.source[10:40].tolist() == [7] * 30


@pytest.mark.parametrize(
    "args, message",
    [
        (([0, 8], [0], [8, 8]), "lengths of local offsets, remote offsets or sizes mismatch"),
        (([0], [0], [1 << 32]), "exceeds UINT32_MAX"),
        (([4090], [0], [8]), "length out of range"),
        (([0], [4095], [2]), "length out of range"),
    ],
)
def test_mori_refuses_a_bad_batch_in_its_status_and_moves_nothing(raw_pair, args, message):
    status = raw_pair.write(*args)
    assert status.Code() == raw_pair.io.StatusCode.ERR_INVALID_ARGS and message in status.Message()
    settle_after(raw_pair)
    assert int(raw_pair.target[:-1].count_nonzero()) == 0


def test_an_empty_batch_succeeds_at_once(raw_pair):
    assert raw_pair.write([], [], []).Succeeded()


def test_a_full_send_queue_fails_the_status_at_once_while_posted_ranges_still_land(
    standin, raw_pair
):
    gate = standin.Gate()
    standin.FAULTS.inject("post", landed=1, hold=gate)
    status = raw_pair.write([0, 64], [0, 64], [64, 64])
    assert status.Failed() and status.Message().startswith("SQ full (")
    gate.open()
    settle_after(raw_pair)
    assert torch.equal(
        raw_pair.target[0:64], raw_pair.source[0:64]
    )  # the first range landed anyway
    assert int(raw_pair.target[64:128].count_nonzero()) == 0
    assert status.Code() == raw_pair.io.StatusCode.ERR_RDMA_OP  # its late success did not stick


def test_an_error_completion_arrives_later_after_the_ranges_before_it(standin, raw_pair):
    standin.FAULTS.inject("completion", landed=1)
    status = raw_pair.write([0, 64], [0, 64], [64, 64])
    assert status.WaitFor(WAIT_MS) == raw_pair.io.StatusCode.ERR_RDMA_OP
    assert torch.equal(raw_pair.target[0:64], raw_pair.source[0:64])
    assert int(raw_pair.target[64:128].count_nonzero()) == 0


def test_a_failed_notification_fails_the_status_while_the_data_still_lands(standin, make_raw_pair):
    pair = make_raw_pair(notifications=True)
    standin.FAULTS.inject("notification")
    status = pair.write([0], [0], [256])
    assert status.Failed() and "notify" in status.Message()
    settle_after(pair)
    assert torch.equal(pair.target[0:256], pair.source[0:256])
    assert status.Failed()


def test_a_notification_rule_waits_for_an_engine_that_sends_notifications(standin, raw_pair):
    rule = standin.FAULTS.inject("notification")
    assert raw_pair.write([0], [0], [8]).WaitFor(WAIT_MS) == raw_pair.io.StatusCode.SUCCESS
    assert rule.times == 1


def test_with_notifications_the_target_learns_of_each_landed_transfer(make_raw_pair, mori_io):
    pair = make_raw_pair(notifications=True)
    uid = pair.session.allocate_transfer_uid()
    assert (
        pair.session.batch_write([0], [0], [8], uid).WaitFor(WAIT_MS) == mori_io.StatusCode.SUCCESS
    )
    inbound = pair.consumer.pop_inbound_transfer_status("raw-producer", uid)
    assert inbound is not None and inbound.Succeeded()
    assert pair.consumer.pop_inbound_transfer_status("raw-producer", uid) is None


def test_a_status_freed_before_its_late_completion_is_reported_as_use_after_free(standin, raw_pair):
    gate = standin.Gate()
    standin.FAULTS.inject("post", landed=1, hold=gate)
    status = raw_pair.write([0, 64], [0, 64], [64, 64])
    assert status.Failed()
    del status
    gc.collect()
    gate.open()
    settle_after(raw_pair)
    seen = standin.incidents.take()
    assert len(seen) == 1 and "use after free" in seen[0] and "batch_write" in seen[0]


def test_a_peer_failure_kills_its_sessions_and_is_handed_out_once(standin, raw_pair):
    native = standin.engines_named("raw-producer")[0]
    native.standin_report_peer_failure("raw-consumer")
    assert not raw_pair.session.alive()
    event = raw_pair.producer.pop_peer_failure()
    assert event.remote_engine_key == "raw-consumer"
    assert event.reason == raw_pair.io.PeerFailureReason.PEER_UNREACHABLE
    assert raw_pair.producer.pop_peer_failure() is None
    status = raw_pair.write([0], [0], [8])
    assert status.WaitFor(WAIT_MS) == raw_pair.io.StatusCode.ERR_RDMA_OP
    assert int(raw_pair.target.count_nonzero()) == 0


def test_a_write_to_an_engine_that_is_gone_fails_and_reports_the_peer(raw_pair):
    del raw_pair.consumer
    gc.collect()
    status = raw_pair.write([0], [0], [8])
    assert status.WaitFor(WAIT_MS) == raw_pair.io.StatusCode.ERR_RDMA_OP
    event = raw_pair.producer.pop_peer_failure()
    assert event.remote_engine_key == "raw-consumer" and not raw_pair.session.alive()
    assert int(raw_pair.target.count_nonzero()) == 0


def test_memory_deregistered_on_either_side_is_never_touched(raw_pair):
    raw_pair.consumer.deregister_memory(raw_pair.target_mem)
    assert raw_pair.write([0], [0], [8]).WaitFor(WAIT_MS) == raw_pair.io.StatusCode.ERR_RDMA_OP
    assert int(raw_pair.target.count_nonzero()) == 0
    raw_pair.target_mem = raw_pair.consumer.register_torch_tensor(raw_pair.target)
    session = raw_pair.producer.create_session(
        raw_pair.source_mem, raw_pair.io.MemoryDesc.unpack(raw_pair.target_mem.pack())
    )
    raw_pair.producer.deregister_memory(raw_pair.source_mem)
    status = session.batch_write([0], [0], [8], session.allocate_transfer_uid())
    assert (
        status.WaitFor(WAIT_MS) == raw_pair.io.StatusCode.ERR_RDMA_OP
        and "local" in status.Message()
    )
    assert int(raw_pair.target.count_nonzero()) == 0


def test_a_session_used_after_its_engine_was_freed_is_reported(standin, raw_pair):
    session = raw_pair.session
    del raw_pair.producer, raw_pair.session
    gc.collect()
    status = session.batch_write([0], [0], [8], 1)
    assert status.Code() == raw_pair.io.StatusCode.ERR_BAD_STATE
    assert any("after its IOEngine was freed" in seen for seen in standin.incidents.take())


class TestBackends:
    def test_port_one_is_refused_by_the_rdma_backend(self, standin, mori_io):
        engine = mori_io.IOEngine("p1", mori_io.IOEngineConfig("127.0.0.1", 1))
        with pytest.raises(RuntimeError, match="port=1 is reserved"):
            engine.create_backend(mori_io.BackendType.RDMA)

    def test_without_an_rdma_device_the_rdma_backend_cannot_be_made(self, standin, mori_io):
        standin.HOST.rdma_device = False
        engine = mori_io.IOEngine("no-nic", mori_io.IOEngineConfig("127.0.0.1", 0))
        with pytest.raises(RuntimeError, match="no active RDMA device"):
            engine.create_backend(mori_io.BackendType.RDMA)
        engine.create_backend(mori_io.BackendType.XGMI)
        assert list(standin.engines_named("no-nic")[0].standin_backends()) == ["XGMI"]

    def test_port_zero_becomes_a_port_of_the_backend_and_a_duplicate_is_skipped(
        self, standin, mori_io
    ):
        engine = mori_io.IOEngine("eph", mori_io.IOEngineConfig("127.0.0.1", 0))
        assert engine.get_engine_desc().port == 0
        engine.create_backend(
            mori_io.BackendType.RDMA, mori_io.RdmaBackendConfig(qp_per_transfer=3)
        )
        port = engine.get_engine_desc().port
        engine.create_backend(
            mori_io.BackendType.RDMA, mori_io.RdmaBackendConfig(qp_per_transfer=5)
        )
        assert port > 1 and engine.get_engine_desc().port == port
        assert standin.engines_named("eph")[0].standin_backends()["RDMA"]["qp_per_transfer"] == 3

    def test_a_config_of_another_backend_is_refused(self, standin, mori_io):
        engine = mori_io.IOEngine("mixed", mori_io.IOEngineConfig("127.0.0.1", 0))
        with pytest.raises(RuntimeError, match="XgmiBackendConfig"):
            engine.create_backend(mori_io.BackendType.RDMA, mori_io.XgmiBackendConfig())

    def test_xgmi_serves_no_host_memory_and_rdma_needs_the_peer_registered(self, standin, mori_io):
        engines = [
            mori_io.IOEngine(key, mori_io.IOEngineConfig("127.0.0.1", 0)) for key in ("x-a", "x-b")
        ]
        engines[0].create_backend(mori_io.BackendType.XGMI)
        engines[0].register_remote_engine(engines[1].get_engine_desc())
        tensors = [torch.zeros(64, dtype=torch.uint8) for _ in engines]
        local, remote = (e.register_torch_tensor(t) for e, t in zip(engines, tensors))
        assert engines[0].create_session(local, remote) is None
        engines[0].create_backend(mori_io.BackendType.RDMA)
        assert engines[0].create_session(local, remote) is not None
        engines[0].deregister_remote_engine(engines[1].get_engine_desc())
        assert engines[0].create_session(local, remote) is None


class TestWaitAll:
    def test_empty_is_success_and_the_first_failure_wins(self, standin, raw_pair):
        io = raw_pair.io
        assert raw_pair.producer.wait_all([]) == io.StatusCode.SUCCESS
        good = raw_pair.write([0], [0], [8])
        bad = raw_pair.write([0], [0], [1 << 32])
        assert raw_pair.producer.wait_all([good, bad]) == io.StatusCode.ERR_INVALID_ARGS

    def test_a_poll_of_a_held_transfer_is_in_progress(self, standin, raw_pair):
        gate = standin.FAULTS.hold()
        held = raw_pair.write([0], [0], [8])
        assert raw_pair.producer.wait_all([held], 0) == raw_pair.io.StatusCode.IN_PROGRESS
        gate.open()
        assert raw_pair.producer.wait_all([held], WAIT_MS) == raw_pair.io.StatusCode.SUCCESS


def test_a_session_over_another_engines_memory_fails_its_posts(raw_pair):
    foreign = raw_pair.producer.create_session(raw_pair.target_mem, raw_pair.remote_mem)
    status = foreign.batch_write([0], [0], [8], foreign.allocate_transfer_uid())
    assert (
        status.WaitFor(WAIT_MS) == raw_pair.io.StatusCode.ERR_RDMA_OP
        and "local" in status.Message()
    )


def test_a_transfer_that_raises_fails_alone_and_the_thread_goes_on(standin, raw_pair, monkeypatch):
    from moriio_fsm.engines.mori_standin import mover

    original = mover.InProcessMover.move
    calls = []

    def raise_once(self, *args):
        calls.append(1)
        if len(calls) == 1:
            raise MemoryError("injected")
        return original(self, *args)

    monkeypatch.setattr(mover.InProcessMover, "move", raise_once)
    failed = raw_pair.write([0], [0], [8])
    assert failed.WaitFor(WAIT_MS) == raw_pair.io.StatusCode.ERR_RDMA_OP
    assert raw_pair.write([8], [8], [8]).WaitFor(WAIT_MS) == raw_pair.io.StatusCode.SUCCESS
    assert torch.equal(raw_pair.target[8:16], raw_pair.source[8:16])

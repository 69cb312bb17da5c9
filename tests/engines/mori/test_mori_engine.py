"""MoriEngine's own promises, through the pinned amd-mori wheel's Python layer over the stand-in ``mori.cpp``:
what it asks mori for, what it refuses to send, and how it reports what mori does.

Rules: each test shows something a user of MoriEngine (or the machines above it) would notice; what mori was asked
is read from the stand-in's record of its backends and posts, never from MoriEngine's own attributes.
"""

import gc
import re
import socket
import sys
import threading
from pathlib import Path

import pytest
import torch

from moriio_fsm.engines import CompletionPoller, MoriEngine, StatusCode
from moriio_fsm.engines.mori import MoriUnavailableError

WAIT_MS = 10_000
REPO = Path(__file__).resolve().parents[3]


def backends_of(standin, key):
    return standin.engines_named(key)[0].standin_backends()


def settle_after(pair):
    """Wait until the stand-in's transfer thread has completed everything handed to it before now."""
    assert pair.write([0], [pair.target.numel() - 1], [1]).wait_for(WAIT_MS)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class TestBackend:
    def test_xgmi_is_made_when_asked_with_its_own_config(self, standin):
        engine = MoriEngine("gpu-side", backend="xgmi", num_streams=8, num_events=4)
        assert engine.backend == "xgmi"
        assert backends_of(standin, "gpu-side") == {"XGMI": {"num_streams": 8, "num_events": 4}}

    def test_rdma_is_the_default_with_the_configuration_given(self, standin):
        port = free_port()
        engine = MoriEngine(
            "p", "127.0.0.1", port, qp_per_transfer=2, post_batch_size=16, poll_cq_mode="event"
        )
        assert engine.key == "p"
        rdma = backends_of(standin, "p")["RDMA"]
        assert (rdma["qp_per_transfer"], rdma["post_batch_size"], rdma["num_worker_threads"]) == (
            2,
            16,
            -1,
        )
        assert rdma["poll_cq_mode"].name == "EVENT"
        desc = standin.engines_named("p")[0].GetEngineDesc()
        assert (desc.host, desc.port) == ("127.0.0.1", port)

    def test_without_an_rdma_device_rdma_is_unavailable_and_xgmi_still_made(self, standin):
        standin.HOST.rdma_device = False
        with pytest.raises(MoriUnavailableError, match="rdma backend.*no active RDMA device"):
            MoriEngine("no-nic")
        engine = MoriEngine("no-nic-xgmi", backend="xgmi")
        memory = engine.register_torch_tensor(torch.zeros(64, dtype=torch.uint8))
        # XGMI moves GPU memory within a node: host tensors get no session.
        assert engine.create_session(memory, memory) is None

    def test_notifications_are_off_unless_asked_for(self, standin):
        engines = [MoriEngine("quiet"), MoriEngine("chatty", enable_notification=True)]
        assert len(engines) == 2
        assert backends_of(standin, "quiet")["RDMA"]["enable_notification"] is False
        assert backends_of(standin, "chatty")["RDMA"]["enable_notification"] is True


class TestRefusedUpFront:
    def test_port_one_is_refused_before_mori_is_called(self, standin):
        with pytest.raises(ValueError, match="port 1 is reserved by mori.io"):
            MoriEngine("sentinel", port=1)
        assert standin.engines_named("sentinel") == []

    @pytest.mark.parametrize(
        "options, named",
        [
            ({"port": 70000}, "port"),
            ({"port": -1}, "port"),
            ({"qp_per_transfer": 0}, "qp_per_transfer"),
            ({"qp_per_transfer": 1 << 31}, "qp_per_transfer"),
            ({"post_batch_size": -2}, "post_batch_size"),
            ({"num_worker_threads": 0}, "num_worker_threads"),
            ({"poll_cq_mode": "busy"}, "poll_cq_mode"),
            ({"backend": "tcp"}, "backend"),
            ({"enable_notification": "yes"}, "enable_notification"),
            ({"num_streams": 1 << 31, "backend": "xgmi"}, "num_streams"),
            ({"num_events": 0}, "num_events"),
        ],
    )
    def test_bad_configuration_is_refused_before_mori_is_called(self, standin, options, named):
        with pytest.raises(ValueError, match=named):
            MoriEngine("refused", **options)
        assert standin.engines_named("refused") == []

    def test_a_uid_mori_cannot_take_comes_back_failed_and_is_never_posted(
        self, engine_pair, monkeypatch
    ):
        posted = []
        native_session = type(engine_pair.session._raw._sess)
        original = native_session.BatchWrite
        monkeypatch.setattr(
            native_session, "BatchWrite", lambda self, *a: posted.append(a) or original(self, *a)
        )
        status = engine_pair.session.batch_write([0], [0], [8], 1 << 64)
        assert (
            status.failed()
            and status.code() == StatusCode.ERR_INVALID_ARGS
            and "uint64" in status.message()
        )
        assert posted == []
        assert engine_pair.session.batch_write([0], [0], [8], (1 << 64) - 1).wait_for(WAIT_MS)
        assert len(posted) == 1


class TestStatuses:
    def test_a_wait_longer_than_a_c_int_is_clamped_not_refused(self, engine_pair):
        status = engine_pair.write([0], [0], [64])
        assert status.wait_for(1 << 40) and status.wait_for(None) and status.wait_for(-5)
        assert status.succeeded()
        assert torch.equal(engine_pair.target[0:64], engine_pair.source[0:64])

    def test_a_failure_whose_writes_may_still_land_is_never_final(self, engine_pair, standin):
        standin.FAULTS.inject("completion", landed=1)
        status = engine_pair.write([0, 64], [0, 64], [64, 64])
        assert not status.wait_for(WAIT_MS)
        assert (
            status.in_progress() and not status.failed() and status.code() == StatusCode.IN_PROGRESS
        )
        assert status.native_code() == StatusCode.ERR_RDMA_OP and status.writes_may_continue()
        assert "may still land" in status.message() and "ERR_RDMA_OP" in status.message()
        assert not engine_pair.producer.wait_all([status], WAIT_MS)
        assert not engine_pair.session.killable  # so the machines quarantine its blocks

    def test_a_failure_before_anything_was_posted_is_final(self, engine_pair, standin):
        standin.FAULTS.inject("post", code=int(StatusCode.ERR_INVALID_ARGS), landed=0)
        status = engine_pair.write([0], [0], [64])
        assert (
            status.wait_for(0) and status.failed() and status.code() == StatusCode.ERR_INVALID_ARGS
        )
        assert not status.writes_may_continue()

    def test_the_poller_reports_no_completion_for_writes_that_may_still_land(
        self, engine_pair, standin
    ):
        events, done_seen = [], threading.Event()

        def deliver(event):
            events.append(event)
            if event.transfer_id == "tx-done":
                done_seen.set()

        standin.FAULTS.inject("post", landed=1)
        torn = engine_pair.write([0, 64], [0, 64], [64, 64])
        done = engine_pair.write([128], [128], [64])
        with CompletionPoller(deliver, poll_interval_s=0.001) as poller:
            poller.submit(torn, "tx-torn", 0)
            poller.submit(done, "tx-done", 0)
            assert done_seen.wait(WAIT_MS / 1000)
            assert poller.pending == 1
        assert [(e.kind, e.transfer_id) for e in events] == [("layer_write_completed", "tx-done")]

    def test_a_status_mori_still_writes_into_after_it_failed_is_kept_alive(
        self, engine_pair, standin
    ):
        gate = standin.Gate()
        standin.FAULTS.inject("post", landed=1, hold=gate)
        status = engine_pair.write([0, 64], [0, 64], [64, 64])
        assert status._raw.Failed()  # mori failed it, and still holds it for the range it posted
        del status
        for _ in range(70):  # enough posts for the keeper to sweep
            engine_pair.write([0], [256], [8])
        assert engine_pair.producer.in_flight_count >= 1
        gc.collect()
        gate.open()
        settle_after(engine_pair)
        assert standin.incidents.take() == []
        assert torch.equal(engine_pair.target[0:64], engine_pair.source[0:64])

    def test_a_status_is_kept_after_close_while_mori_may_write_into_it(self, engine_pair, standin):
        gate = standin.FAULTS.hold()
        status = engine_pair.write([0], [0], [64])
        engine_pair.producer.close()
        del status
        gc.collect()
        gate.open()
        assert standin.drain()
        assert standin.incidents.take() == []
        assert torch.equal(engine_pair.target[0:64], engine_pair.source[0:64])

    def test_successful_statuses_are_let_go(self, engine_pair):
        statuses = [engine_pair.write([i * 8], [i * 8], [8]) for i in range(200)]
        assert engine_pair.producer.wait_all(statuses, WAIT_MS)
        del statuses
        assert engine_pair.producer.in_flight_count == 0

    def test_posting_queries_a_bounded_number_of_statuses_however_many_are_kept(
        self, engine_pair, standin, monkeypatch
    ):
        gate = standin.FAULTS.hold(times=3000)
        native_status = type(engine_pair.write([0], [0], [8])._raw)
        queries = []
        original = native_status.Code
        monkeypatch.setattr(native_status, "Code", lambda self: queries.append(1) or original(self))
        for _i in range(3000):
            engine_pair.write([0], [0], [8])
        # Sweeping every kept status at each post would cost about 3000**2 / 2 queries.
        assert len(queries) <= 3 * 3000
        assert engine_pair.producer.in_flight_count >= 3000
        gate.open()
        assert standin.drain()
        assert engine_pair.producer.in_flight_count == 0


class TestPeers:
    def test_a_peer_failure_mori_reports_ends_the_session_and_is_kept(self, engine_pair, standin):
        assert engine_pair.session.alive()
        standin.engines_named("mori-p")[0].standin_report_peer_failure(
            "mori-d", detail="retry exceeded"
        )
        assert not engine_pair.session.alive()
        failures = engine_pair.producer.peer_failures()
        assert [(f.remote_engine_key, f.reason, f.detail) for f in failures] == [
            ("mori-d", "PEER_UNREACHABLE", "retry exceeded")
        ]

    def test_a_failure_of_another_peer_leaves_this_session_alive(self, engine_pair, standin):
        standin.engines_named("mori-p")[0].standin_report_peer_failure("someone-else")
        assert engine_pair.session.alive()
        assert [f.remote_engine_key for f in engine_pair.producer.peer_failures()] == [
            "someone-else"
        ]
        assert not engine_pair.producer.peer_alive("someone-else")

    def test_a_device_failure_ends_every_session(self, engine_pair, standin):
        reason = sys.modules["mori.cpp"].PeerFailureReason.LOCAL_DEVICE_FATAL
        standin.engines_named("mori-p")[0].standin_report_peer_failure("", reason)
        assert not engine_pair.session.alive()
        assert engine_pair.producer.peer_failures()[0].reason == "LOCAL_DEVICE_FATAL"

    def test_a_write_to_a_peer_that_is_gone_reports_it(self, engine_pair):
        engine_pair.consumer.close()
        del engine_pair.consumer
        gc.collect()
        status = engine_pair.write([0], [0], [8])
        assert not status.wait_for(WAIT_MS) and status.native_code() == StatusCode.ERR_RDMA_OP
        assert not engine_pair.session.alive()
        assert engine_pair.producer.peer_failures()[0].remote_engine_key == "mori-d"


def test_the_mori_extra_pins_the_wheel_these_tests_run(standin):
    tomllib = pytest.importorskip("tomllib")
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    pins = [re.match(r"amd-mori==([^;\s]+)", line) for line in extras["mori"]]
    assert [pin.group(1) for pin in pins if pin] == [standin.PINNED_VERSION]


def test_bytes_unpack_from_any_bytes_like_and_nothing_else(engine_pair):
    packed = engine_pair.target_mem.pack()
    assert (
        engine_pair.producer.unpack_memory_desc(bytearray(packed)).size
        == engine_pair.target.numel()
    )
    assert (
        engine_pair.producer.unpack_memory_desc(memoryview(packed)).size
        == engine_pair.target.numel()
    )
    with pytest.raises(TypeError, match="memory descriptor"):
        engine_pair.producer.unpack_memory_desc(packed.decode("latin-1"))
    with pytest.raises(TypeError, match="mori MemoryDesc"):
        engine_pair.producer.create_session(object(), object())

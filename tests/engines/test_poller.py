"""CompletionPoller: one runtime Event per status, delivered off the posting thread.

Events are read from a queue with bounded waits, never by sleeping; event times come
from an injected clock, so no test depends on how fast the poller thread runs.
"""

import queue
import threading
import time

import pytest

from moriio_fsm.engines import CompletionPoller, StatusCode
from moriio_fsm.engines.status import LocalTransferStatus, failed_status
from moriio_fsm.runtime.events import Event

WAIT_S = 10


def succeeded():
    status = LocalTransferStatus()
    status.settle(StatusCode.SUCCESS)
    return status


@pytest.fixture
def delivered():
    return queue.Queue()


@pytest.fixture
def poller(delivered):
    with CompletionPoller(delivered.put, poll_interval_s=0.001) as started:
        yield started


def test_a_successful_write_becomes_layer_write_completed(poller, delivered):
    poller.submit(succeeded(), "tx-1", 3, "write")
    event = delivered.get(timeout=WAIT_S)
    assert isinstance(event, Event)
    assert (event.transfer_id, event.kind, dict(event.data)) == (
        "tx-1",
        "layer_write_completed",
        {"layer": 3},
    )


def test_a_failed_write_carries_its_code_and_message(poller, delivered):
    poller.submit(failed_status(StatusCode.ERR_RDMA_OP, "link down"), "tx-2", 0)
    event = delivered.get(timeout=WAIT_S)
    assert event.kind == "layer_write_failed"
    assert dict(event.data) == {"layer": 0, "code": 13, "message": "link down"}


def test_reads_become_read_events(poller, delivered):
    poller.submit(succeeded(), "tx-r", 1, "read")
    poller.submit(failed_status(StatusCode.ERR_NOT_FOUND, "no such region"), "tx-r", 2, "read")
    kinds = {delivered.get(timeout=WAIT_S).kind for _ in range(2)}
    assert kinds == {"layer_read_completed", "layer_read_failed"}


def test_a_status_is_reported_only_once_it_is_final(poller, delivered):
    status = LocalTransferStatus()
    status.mark_in_progress()
    poller.submit(status, "tx-3", 5)
    with pytest.raises(queue.Empty):
        delivered.get(timeout=0.1)
    assert poller.pending == 1
    status.settle(StatusCode.SUCCESS)
    assert delivered.get(timeout=WAIT_S).kind == "layer_write_completed"
    with pytest.raises(queue.Empty):
        delivered.get(timeout=0.1)


class FakeClock:
    def __init__(self, now: float):
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_events_are_delivered_from_the_poller_thread_stamped_by_its_clock(delivered):
    threads = []
    clock = FakeClock(1234.5)

    def deliver(event):
        threads.append(threading.current_thread())
        delivered.put(event)

    with CompletionPoller(deliver, name="completion-test", clock=clock) as poller:
        poller.submit(succeeded(), "tx-4", 0)
        first = delivered.get(timeout=WAIT_S)
        clock.now = 1300.0
        poller.submit(succeeded(), "tx-5", 0)
        second = delivered.get(timeout=WAIT_S)
    assert threads[0].name == "completion-test" and threads[0] is not threading.current_thread()
    assert (first.time, second.time) == (1234.5, 1300.0)


def in_progress():
    status = LocalTransferStatus()
    status.mark_in_progress()
    return status


def test_forget_drops_a_transfers_statuses_and_no_event_ever_follows(poller, delivered):
    abandoned = [in_progress() for _ in range(3)]
    for layer, status in enumerate(abandoned):
        poller.submit(status, "tx-abandoned", layer)
    kept = in_progress()
    poller.submit(kept, "tx-kept", 0)
    assert poller.forget("tx-abandoned") == 3
    assert poller.pending == 1
    assert poller.forget("tx-abandoned") == 0 and poller.forget("tx-unknown") == 0
    for status in abandoned:
        status.settle(StatusCode.SUCCESS)
    kept.settle(StatusCode.SUCCESS)
    assert delivered.get(timeout=WAIT_S).transfer_id == "tx-kept"
    assert poller.close() == 0
    assert delivered.empty()


def test_forget_finds_statuses_wherever_the_sweep_has_them(delivered):
    statuses = [in_progress() for _ in range(2000)]
    with CompletionPoller(delivered.put, batch_size=7, poll_interval_s=0.0005) as poller:
        for index, status in enumerate(statuses):
            poller.submit(status, "tx-x" if index % 2 else "tx-y", index)
        # Queued, pending or in the batch being swept right now: each is dropped once.
        assert poller.forget("tx-x") == 1000
        for status in statuses:
            status.settle(StatusCode.SUCCESS)
        events = [delivered.get(timeout=WAIT_S) for _ in range(1000)]
        assert poller.close() == 0
    assert {e.transfer_id for e in events} == {"tx-y"} and delivered.empty()


def test_forget_needs_a_transfer_id_string(poller):
    with pytest.raises(TypeError, match="transfer_id"):
        poller.forget(7)


def test_every_status_of_a_flood_is_delivered_exactly_once(delivered):
    statuses = [LocalTransferStatus() for _ in range(1000)]
    with CompletionPoller(delivered.put, batch_size=16, poll_interval_s=0.0005) as poller:
        for layer, status in enumerate(statuses):
            poller.submit(status, f"tx-{layer % 10}", layer)
        for index, status in enumerate(statuses):
            status.settle(StatusCode.SUCCESS if index % 3 else StatusCode.ERR_RDMA_OP, "x")
        events = [delivered.get(timeout=WAIT_S) for _ in statuses]
        assert poller.pending == 0
    assert sorted(e.data["layer"] for e in events) == list(range(1000))
    assert sum(e.kind == "layer_write_failed" for e in events) == 334
    assert delivered.empty()


def test_a_failing_callback_does_not_stop_later_deliveries(delivered):
    calls = []

    def deliver(event):
        calls.append(event)
        if len(calls) == 1:
            raise RuntimeError("consumer bug")
        delivered.put(event)

    with CompletionPoller(deliver) as poller:
        poller.submit(succeeded(), "tx-a", 0)
        poller.submit(succeeded(), "tx-b", 1)
        assert delivered.get(timeout=WAIT_S).transfer_id == "tx-b"
        assert poller.delivery_errors == 1


def test_close_reports_statuses_that_never_finished(delivered):
    poller = CompletionPoller(delivered.put)
    poller.submit(LocalTransferStatus(), "tx-stuck", 0)
    assert poller.close() == 1
    with pytest.raises(RuntimeError, match="closed"):
        poller.submit(succeeded(), "tx-late", 0)


@pytest.mark.parametrize(
    "args, error, named",
    [
        (("tx", 0, "copy"), ValueError, "op"),
        (("tx", -1, "write"), ValueError, "layer"),
        ((42, 0, "write"), TypeError, "transfer_id"),
    ],
)
def test_bad_submissions_are_refused(poller, args, error, named):
    with pytest.raises(error, match=named):
        poller.submit(succeeded(), *args)


def test_poller_with_a_loopback_engine_reports_each_layer(loopback_pair, delivered):
    loopback_pair.producer.faults.fail_nth(3)
    with CompletionPoller(delivered.put) as poller:
        for layer in range(4):
            status = loopback_pair.session.batch_write(
                [layer * 512], [layer * 512], [512], loopback_pair.session.allocate_transfer_uid()
            )
            poller.submit(status, "tx-engine", layer)
        events = sorted(
            (delivered.get(timeout=WAIT_S) for _ in range(4)), key=lambda e: e.data["layer"]
        )
    assert [e.kind for e in events] == ["layer_write_completed"] * 2 + [
        "layer_write_failed",
        "layer_write_completed",
    ]
    assert events[2].data["code"] == StatusCode.ERR_RDMA_OP


# -- waking on settle ------------------------------------------------------------------


class PolledOnly:
    """A status with mori.io's query surface and no way to call back: it must be polled."""

    def __init__(self):
        self.inner = LocalTransferStatus()
        self.inner.mark_in_progress()

    def __getattr__(self, name):
        if name == "when_final":
            raise AttributeError(name)
        return getattr(self.inner, name)


def test_a_status_that_calls_back_is_delivered_without_polling(delivered):
    # A poll interval longer than the test's wait: only the status's call-back can wake the poller.
    with CompletionPoller(delivered.put, poll_interval_s=3600) as slow:
        status = LocalTransferStatus()
        status.mark_in_progress()
        slow.submit(status, "tx-wake", 2)
        with pytest.raises(queue.Empty):
            delivered.get(timeout=0.05)
        status.settle(StatusCode.SUCCESS)
        assert delivered.get(timeout=WAIT_S).kind == "layer_write_completed"
        # Several at once, settled from other threads, all arrive.
        many = [LocalTransferStatus() for _ in range(50)]
        for n, each in enumerate(many):
            each.mark_in_progress()
            slow.submit(each, f"tx-many-{n}", 0)
        threads = [
            threading.Thread(target=each.settle, args=(StatusCode.SUCCESS,)) for each in many
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert {delivered.get(timeout=WAIT_S).transfer_id for _ in many} == {
            f"tx-many-{n}" for n in range(50)
        }


def test_a_status_without_call_backs_is_still_polled(delivered):
    with CompletionPoller(delivered.put, poll_interval_s=0.001) as poller:
        status = PolledOnly()
        poller.submit(status, "tx-polled", 1)
        status.inner.settle(StatusCode.ERR_RDMA_OP, "gone")
        event = delivered.get(timeout=WAIT_S)
        assert (event.kind, event.data["message"]) == ("layer_write_failed", "gone")


def test_a_settled_status_far_down_a_long_queue_is_still_found(delivered):
    # More pending than one sweep takes: the sweep that misses the settled one must not sleep for good.
    with CompletionPoller(delivered.put, poll_interval_s=0.001, batch_size=4) as poller:
        statuses = [LocalTransferStatus() for _ in range(40)]
        for n, status in enumerate(statuses):
            status.mark_in_progress()
            poller.submit(status, f"tx-{n}", 0)
        statuses[37].settle(StatusCode.SUCCESS)
        assert delivered.get(timeout=WAIT_S).transfer_id == "tx-37"
        assert delivered.empty()  # the other 39 are still in progress


def test_event_if_final_answers_for_final_statuses_only(poller):
    assert poller.event_if_final(succeeded(), "tx-now", 4, "read").kind == "layer_read_completed"
    failed = poller.event_if_final(failed_status(StatusCode.ERR_BAD_STATE, "closed"), "tx-now", 5)
    assert failed.kind == "layer_write_failed" and failed.data["code"] == StatusCode.ERR_BAD_STATE
    running = LocalTransferStatus()
    running.mark_in_progress()
    assert poller.event_if_final(running, "tx-later", 0) is None
    assert poller.pending == 0  # nothing was queued by asking
    with pytest.raises(ValueError, match="op must be one of"):
        poller.event_if_final(succeeded(), "tx", 0, "copy")


def test_when_final_calls_back_once_now_or_at_settle_and_survives_a_raising_callback(caplog):
    calls: list[str] = []
    status = LocalTransferStatus()
    status.when_final(lambda: calls.append("first"))
    status.when_final(lambda: 1 / 0)
    status.when_final(lambda: calls.append("after the raising one"))
    assert calls == []
    assert status.settle(StatusCode.SUCCESS)
    assert calls == ["first", "after the raising one"]
    assert "when_final callback raised" in caplog.text
    assert not status.settle(StatusCode.ERR_RDMA_OP)  # settling again calls no one
    assert calls == ["first", "after the raising one"]
    status.when_final(lambda: calls.append("late"))  # already final: at once
    assert calls[-1] == "late"
    with pytest.raises(TypeError, match="callback must be callable"):
        status.when_final("not callable")


def test_an_event_carries_the_time_its_transfer_ended_not_the_time_it_was_noticed(delivered):
    """On time.monotonic's clock a status that says when it ended gives its event that time,
    whether the poster asks at once or the poller thread notices later."""
    ended = LocalTransferStatus()
    ended.settle(StatusCode.SUCCESS, ended_at=time.monotonic() - 0.5)
    with CompletionPoller(delivered.put) as poller:
        asked = time.monotonic()
        assert poller.event_if_final(ended, "tx-e", 0).time == ended.final_at() < asked - 0.4
        later = LocalTransferStatus()
        later.mark_in_progress()
        poller.submit(later, "tx-f", 1)
        before = time.monotonic()
        later.settle(StatusCode.ERR_RDMA_OP, "lost", ended_at=before - 0.25)
        event = delivered.get(timeout=WAIT_S)
    assert event.kind == "layer_write_failed" and event.time == later.final_at() < before


class ClaimsAnything(LocalTransferStatus):
    """A status of unknown make whose end time is whatever it is told to say."""

    __slots__ = ("claim",)

    def final_at(self):
        return self.claim


@pytest.mark.parametrize(
    "claim", [float("nan"), float("inf"), float("-inf"), 1e300, -1e300, "yesterday", 5, None]
)
def test_an_end_time_that_is_not_a_past_monotonic_reading_is_replaced_by_the_pollers_clock(
    poller, claim
):
    status = ClaimsAnything()
    status.claim = claim
    status.settle(StatusCode.SUCCESS)
    before = time.monotonic()
    event = poller.event_if_final(status, "tx-claim", 0)
    assert before <= event.time <= time.monotonic()


def test_a_poller_on_another_clock_never_mixes_in_the_statuses_end_times(delivered):
    status = LocalTransferStatus()
    status.settle(StatusCode.SUCCESS, ended_at=time.monotonic() - 1.0)
    with CompletionPoller(delivered.put, clock=FakeClock(77.0)) as poller:
        assert poller.event_if_final(status, "tx-fake", 0).time == 77.0


@pytest.mark.parametrize(
    "ended_at", [float("nan"), float("inf"), float("-inf"), -1e300, "now", 3, 1e300]
)
def test_settle_refuses_an_end_time_that_is_not_a_past_monotonic_reading_and_stays_open(ended_at):
    status = LocalTransferStatus()
    status.mark_in_progress()
    with pytest.raises(ValueError, match="ended_at must be a time.monotonic"):
        status.settle(StatusCode.SUCCESS, ended_at=ended_at)
    assert status.in_progress() and status.final_at() is None
    assert status.settle(StatusCode.SUCCESS) and status.final_at() <= time.monotonic()

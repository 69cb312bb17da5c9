"""The in-flight core the loopback, same-host and NIXL engines share: a batch is handed out once, when due, and
close hands back every batch not handed out, whatever the faults did to it.

No test sleeps to let a thread run: the queue is driven from the test's own thread.
"""

import threading

import pytest

from moriio_fsm.engines.checks import CheckedBatch
from moriio_fsm.engines.copy_split import CopyHelpers, byte_slices
from moriio_fsm.engines.faults import FaultVerdict, HeldTransfers
from moriio_fsm.engines.inflight import Posted, PostQueue, serve
from moriio_fsm.engines.status import LocalTransferStatus, StatusCode


def posted(uid: int) -> Posted:
    return Posted(LocalTransferStatus(), None, "write", CheckedBatch([0], [0], [8], uid))


def test_batches_due_now_are_handed_out_in_order_at_most_most_at_a_time():
    queue = PostQueue(most=2)
    batches = [posted(uid) for uid in range(1, 6)]
    for batch in batches:
        assert queue.put(batch, queue.number())
    assert (
        queue.take(0) == batches[:2]
        and queue.take(0) == batches[2:4]
        and queue.take(0) == batches[4:]
    )
    assert queue.take(0) == []  # nothing left: the wait runs out


def test_a_stalled_batch_is_never_handed_out_and_a_held_one_only_once_released():
    queue, hold = PostQueue(most=None), HeldTransfers()
    stalled, held, plain = posted(1), posted(2), posted(3)
    assert queue.put(stalled, queue.number(), FaultVerdict(stall=True))
    assert queue.put(held, queue.number(), FaultVerdict(hold=hold))
    assert queue.put(plain, queue.number())
    assert queue.take(0) == [plain] and queue.take(0) == []
    assert hold.release() == 1
    assert queue.take(0) == [held] and queue.take(0) == []


def test_a_delayed_batch_is_not_due_before_its_time():
    queue = PostQueue()
    assert queue.put(posted(1), queue.number(), FaultVerdict(delay_s=3600.0))
    assert queue.take(0) == []


def test_close_hands_back_what_is_queued_stalled_held_or_delayed_and_refuses_more():
    queue, hold = PostQueue(), HeldTransfers()
    batches = [posted(uid) for uid in range(1, 5)]
    verdicts = [
        FaultVerdict(),
        FaultVerdict(stall=True),
        FaultVerdict(hold=hold),
        FaultVerdict(delay_s=3600.0),
    ]
    for batch, verdict in zip(batches, verdicts):
        assert queue.put(batch, queue.number(), verdict)
    abandoned = queue.close()
    assert sorted(batch.batch.transfer_uid for batch in abandoned) == [1, 2, 3, 4]
    assert queue.close() is None  # once
    assert (
        queue.number() is None
        and not queue.put(posted(9), 9)
        and not queue.put_due([(9, posted(9))])
    )
    assert (
        hold.release() == 1 and queue.take(0) is None
    )  # a release after close brings nothing back


def test_a_closed_queue_wakes_its_taker():
    queue, taken = PostQueue(), []
    taker = threading.Thread(target=lambda: taken.append(queue.take()))
    taker.start()
    queue.close()
    taker.join(10)
    assert not taker.is_alive() and taken == [None]


def test_the_worker_loop_settles_each_status_with_its_label_and_stops_at_close():
    queue = PostQueue(most=None)
    batches = [posted(1), posted(2)]
    for batch in batches:
        queue.put(batch, queue.number())
    outcomes = iter([[(StatusCode.SUCCESS, "", None), (StatusCode.ERR_RDMA_OP, "peer gone", None)]])
    worker = threading.Thread(target=serve, args=(queue, lambda due: next(outcomes)))
    worker.start()
    assert all(batch.status.wait_for(10_000) for batch in batches)
    queue.close()
    worker.join(10)
    assert not worker.is_alive()
    assert batches[0].status.succeeded() and batches[0].status.message() == ""
    assert batches[1].status.code() == StatusCode.ERR_RDMA_OP
    assert batches[1].status.message() == "batch_write uid 2: peer gone"


@pytest.mark.parametrize(
    "sizes, parts, slices",
    [
        ([10, 10, 10, 10], 2, [(0, 2), (2, 4)]),
        ([100, 1, 1, 1], 2, [(0, 1), (1, 4)]),
        ([5], 2, [(0, 1)]),
    ],
)
def test_a_batch_is_cut_where_its_bytes_pass_each_equal_share(sizes, parts, slices):
    assert byte_slices(sizes, sum(sizes), parts) == slices


def test_a_failing_slice_is_raised_only_once_every_slice_has_ended():
    helpers, ended, release = CopyHelpers(2, "test-split"), [], threading.Event()

    def copy_slice(a, b):
        if a == 0:
            raise OSError("the first slice failed")
        release.wait(10)  # the helper's slice is still copying when the first fails
        ended.append((a, b))

    try:
        threading.Timer(0.05, release.set).start()
        with pytest.raises(OSError, match="first slice"):
            helpers.run(copy_slice, [8, 8], 16, min_bytes=1)
        assert ended == [(1, 2)]
    finally:
        release.set()
        helpers.shutdown()


def test_a_batch_below_the_threshold_is_copied_by_the_caller_alone():
    helpers, threads = CopyHelpers(2, "test-split"), []
    helpers.run(
        lambda a, b: threads.append((threading.current_thread(), a, b)), [8, 8], 16, min_bytes=17
    )
    assert threads == [(threading.current_thread(), 0, 2)]
    helpers.shutdown()

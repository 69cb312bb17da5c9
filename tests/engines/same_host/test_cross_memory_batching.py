"""CrossMemoryEngine's ways of saving hand-offs: due batches go to the kernel together, and copies on the poster.

Rules: the kernel is real unless a test puts a stand-in in ``iovec.SYSCALLS`` (one that blocks the worker, counts
calls, or refuses one batch's addresses); every wait is bounded and no test reads the clock.
"""

import errno
import threading

import pytest
import torch

from moriio_fsm.engines import StatusCode
from moriio_fsm.engines.same_host import iovec

from ..conftest import Pair
from .test_cross_memory import WAIT_MS, BlockingKernel, iovecs, landed

SIZE = 1 << 16
CHUNK = 256


@pytest.fixture
def cma():
    made = Pair("cross_memory", size=SIZE)
    yield made
    made.close()


class CountingKernel:
    """The real syscall behind a first call that waits for ``go``; iovecs per call are kept, and
    any call covering a remote address in ``refused`` fails with EFAULT (a peer's unmapped page)."""

    def __init__(self, blocking: BlockingKernel, refused: range | None = None):
        self.blocking = blocking
        self.refused = refused
        self.counts: list[int] = []

    def __call__(self, pid, local_iov, remote_iov, count):
        self.counts.append(count)
        if self.refused is not None:
            remote = iovecs(remote_iov, count)
            if any(remote[2 * i] in self.refused for i in range(count)):
                return -errno.EFAULT
        return self.blocking(pid, local_iov, remote_iov, count)


def post_behind_a_busy_worker(pair, monkeypatch, batches: int, refused_batch: int | None = None):
    """Block the worker in a first copy, post ``batches`` one-range batches meanwhile, then let it go."""
    blocking = BlockingKernel("write")
    base = pair.remote_mem.address
    refused = None
    if refused_batch is not None:
        start = base + (1 + refused_batch) * CHUNK
        refused = range(start, start + CHUNK)
    kernel = CountingKernel(blocking, refused)
    monkeypatch.setitem(iovec.SYSCALLS, "write", kernel)
    first = pair.session.write(0, 0, CHUNK, pair.session.allocate_transfer_uid())
    assert blocking.entered.wait(WAIT_MS / 1000)
    ranges = [((1 + n) * CHUNK, (1 + n) * CHUNK, CHUNK) for n in range(batches)]
    statuses = [
        pair.session.write(lo, ro, size, pair.session.allocate_transfer_uid())
        for lo, ro, size in ranges
    ]
    assert all(status.in_progress() for status in statuses)  # queued behind the blocked copy
    blocking.go.set()
    assert pair.producer.wait_all([first, *statuses], WAIT_MS)
    return kernel, statuses, ranges


def test_batches_due_together_go_to_the_kernel_in_one_call(cma, monkeypatch):
    kernel, statuses, ranges = post_behind_a_busy_worker(cma, monkeypatch, batches=6)
    assert all(status.succeeded() for status in statuses)
    assert kernel.counts == [1, 6]  # the first batch, then the six queued ones at once
    lo, ro, sizes = map(list, zip(*ranges))
    assert landed(cma, lo, ro, sizes)


def test_when_the_joint_call_fails_each_batch_gets_its_own_outcome(cma, monkeypatch):
    kernel, statuses, ranges = post_behind_a_busy_worker(
        cma, monkeypatch, batches=5, refused_batch=2
    )
    assert [status.code() for status in statuses] == [StatusCode.SUCCESS] * 2 + [
        StatusCode.ERR_RDMA_OP
    ] + [StatusCode.SUCCESS] * 2
    assert "not mapped" in statuses[2].message() and f"uid {4}" in statuses[2].message()
    assert kernel.counts == [1, 5, 1, 1, 1, 1, 1]  # the joint call, then one each
    good = [r for n, r in enumerate(ranges) if n != 2]
    lo, ro, sizes = map(list, zip(*good))
    assert landed(cma, lo, ro, sizes)
    assert not torch.equal(
        cma.target[ranges[2][1] : ranges[2][1] + CHUNK],
        cma.source[ranges[2][0] : ranges[2][0] + CHUNK],
    )


def test_a_batch_with_an_injected_failure_is_not_copied_with_the_others(cma, monkeypatch):
    cma.producer.faults.fail_nth(3)  # the third batch posted: the second queued one
    kernel, statuses, _ = post_behind_a_busy_worker(cma, monkeypatch, batches=4)
    assert [status.succeeded() for status in statuses] == [True, False, True, True]
    assert kernel.counts == [1, 3]


def test_an_inline_engine_copies_on_the_poster_and_hands_back_a_final_status():
    pair = Pair("cross_memory_inline", size=SIZE)
    try:
        poster = threading.current_thread().name
        seen: list[str] = []
        real = iovec.SYSCALLS["write"]

        def kernel(*args):
            seen.append(threading.current_thread().name)
            return real(*args)

        iovec.SYSCALLS["write"] = kernel
        try:
            status = pair.session.batch_write(
                [0, 512], [4096, 0], [512, 256], pair.session.allocate_transfer_uid()
            )
        finally:
            iovec.SYSCALLS["write"] = real
        assert status.succeeded() and seen == [poster]
        assert landed(pair, [0, 512], [4096, 0], [512, 256])
        # A fault that delays the copy sends it to the worker: posting still returns at once.
        pair.producer.faults.set_latency(0.05)
        delayed = pair.session.write(0, 0, 64, pair.session.allocate_transfer_uid())
        assert delayed.in_progress()
        assert delayed.wait_for(WAIT_MS) and delayed.succeeded()
    finally:
        pair.close()


def test_an_engine_on_one_core_copies_inline_by_default(monkeypatch):
    import os

    from moriio_fsm.engines.same_host import CrossMemoryEngine

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    with CrossMemoryEngine("one-core") as engine:
        assert engine.inline_copies
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    with CrossMemoryEngine("two-cores") as engine:
        assert not engine.inline_copies
    with CrossMemoryEngine("asked", inline_copies=True) as engine:
        assert engine.inline_copies


# -- pinned memory ------------------------------------------------------------------------


def locked_kib() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmLck:"):
                return int(line.split()[1])
    raise AssertionError("no VmLck in /proc/self/status")


def test_registered_memory_stays_locked_until_it_is_deregistered():
    before = locked_kib()
    pair = Pair("cross_memory", size=4 << 20)
    try:
        # Both sides' 4 MiB (the producer's source, the consumer's target) are resident.
        assert locked_kib() - before >= 2 * 4096
        pair.consumer.deregister_memory(pair.target_mem)
        assert locked_kib() - before < 2 * 4096
    finally:
        pair.close()
    assert locked_kib() == before


def test_an_engine_asked_not_to_pin_locks_nothing():
    before = locked_kib()
    pair = Pair("cross_memory", size=4 << 20, pin_memory=False)
    try:
        assert locked_kib() == before
    finally:
        pair.close()


def test_a_refused_lock_is_said_once_naming_the_limit_and_the_memory_still_moves(
    monkeypatch, caplog
):
    import ctypes

    from moriio_fsm.engines.same_host import resident

    def refuse(address, length):
        ctypes.set_errno(errno.ENOMEM)
        return -1

    monkeypatch.setattr(resident, "_mlock", refuse)
    monkeypatch.setattr(resident, "_warned", threading.Event())
    pair = Pair("cross_memory", size=SIZE)
    try:
        warnings = [r.getMessage() for r in caplog.records if "could not lock" in r.getMessage()]
        assert len(warnings) == 1  # two registrations, one warning
        assert (
            "RLIMIT_MEMLOCK" in warnings[0]
            and "ulimit -l" in warnings[0]
            and "ENOMEM" in warnings[0]
        )
        status = pair.session.write(0, 128, 512, pair.session.allocate_transfer_uid())
        assert status.wait_for(WAIT_MS) and status.succeeded()
        assert landed(pair, [0], [128], [512])
    finally:
        pair.close()


# -- posting together ---------------------------------------------------------------------


class Recording:
    """The real syscall, with the iovec count of every call and the thread that made it."""

    def __init__(self, op: str = "write"):
        self.real = iovec.SYSCALLS[op]
        self.calls: list[tuple[int, str]] = []

    def __call__(self, pid, local_iov, remote_iov, count):
        self.calls.append((count, threading.current_thread().name))
        return self.real(pid, local_iov, remote_iov, count)


@pytest.mark.parametrize("kind", ["cross_memory", "cross_memory_inline"])
def test_posts_made_together_wait_for_the_block_to_end_then_go_in_one_call(kind, monkeypatch):
    pair = Pair(kind, size=SIZE)
    try:
        kernel = Recording()
        monkeypatch.setitem(iovec.SYSCALLS, "write", kernel)
        ranges = [(n * CHUNK, SIZE - (n + 1) * CHUNK, CHUNK) for n in range(8)]
        with pair.producer.posting_together():
            with pair.producer.posting_together():  # nested: the outer one flushes
                statuses = [
                    pair.session.write(*r, pair.session.allocate_transfer_uid()) for r in ranges[:4]
                ]
            statuses += [
                pair.session.write(*r, pair.session.allocate_transfer_uid()) for r in ranges[4:]
            ]
            assert all(status.in_progress() for status in statuses) and kernel.calls == []
        assert pair.producer.wait_all(statuses, WAIT_MS)
        assert all(status.succeeded() for status in statuses)
        assert [count for count, _ in kernel.calls] == [8]
        if kind == "cross_memory_inline":
            assert kernel.calls[0][1] == threading.current_thread().name
        lo, ro, sizes = map(list, zip(*ranges))
        assert landed(pair, lo, ro, sizes)
    finally:
        pair.close()


def test_posts_of_another_thread_are_not_held(cma):
    with cma.producer.posting_together():
        other: list = []
        thread = threading.Thread(
            target=lambda: other.append(
                cma.session.write(0, 0, CHUNK, cma.session.allocate_transfer_uid())
            )
        )
        thread.start()
        thread.join()
        assert (
            other[0].wait_for(WAIT_MS) and other[0].succeeded()
        )  # settled while this block still runs


def test_a_block_left_by_an_exception_still_ends_every_status(cma):
    statuses = []
    with pytest.raises(RuntimeError, match="forward failed"):
        with cma.producer.posting_together():
            statuses.append(cma.session.write(0, 0, CHUNK, cma.session.allocate_transfer_uid()))
            raise RuntimeError("forward failed")
    assert cma.producer.wait_all(statuses, WAIT_MS) and statuses[0].succeeded()


def test_a_close_before_the_block_ends_fails_what_it_held(cma):
    with cma.producer.posting_together():
        status = cma.session.write(0, 0, CHUNK, cma.session.allocate_transfer_uid())
        cma.producer.close()
    assert status.wait_for(WAIT_MS)
    assert (
        status.code() == StatusCode.ERR_BAD_STATE
        and "closed before the transfer completed" in status.message()
    )


def test_a_delayed_post_is_not_held_by_the_block(cma):
    cma.producer.faults.set_latency(0.01)
    with cma.producer.posting_together():
        status = cma.session.write(0, 0, CHUNK, cma.session.allocate_transfer_uid())
        assert (
            status.wait_for(WAIT_MS) and status.succeeded()
        )  # it went at once, through the worker


def test_wait_for_copies_returns_when_the_copy_on_another_thread_ends(cma, monkeypatch):
    blocking = BlockingKernel("write")
    monkeypatch.setitem(iovec.SYSCALLS, "write", blocking)
    assert cma.producer.wait_for_copies(0)  # nothing copying
    status = cma.session.write(0, 0, CHUNK, cma.session.allocate_transfer_uid())
    assert blocking.entered.wait(WAIT_MS / 1000)
    assert not cma.producer.wait_for_copies(0.01)  # bounded: the copy is still held
    releaser = threading.Timer(0.05, blocking.go.set)
    releaser.start()
    try:
        assert cma.producer.wait_for_copies(WAIT_MS / 1000)
        assert status.wait_for(WAIT_MS) and status.succeeded()
    finally:
        releaser.cancel()


# -- overlapping holds of one registration ------------------------------------------------


def test_overlapping_holds_keep_the_slot_until_the_last_one_is_released():
    import os

    from moriio_fsm.engines.same_host.registry import PublishedRegistry, RegistryView

    table = PublishedRegistry(8)
    view = RegistryView.open(os.getpid(), table.fd, table.token)
    try:
        slot = table.publish(1, 0x10000, 4096)
        # Two copies through one open of the table: two threads, or two batches of one call.
        assert view.hold(slot, 1, 0x10000, 4096) and view.hold(slot, 1, 0x10000, 4096)
        view.release(slot)  # the first copy ends
        assert not table.withdraw(slot, 0.0)  # the second still keeps the memory
        view.release(slot)
        assert table.withdraw(slot, 0.0)
        other = table.publish(2, 0x20000, 4096)
        assert view.hold(other, 2, 0x20000, 4096)
        assert not view.hold(other, 99, 0x20000, 4096)  # a stale descriptor holds nothing...
        assert not table.withdraw(other, 0.0)  # ...and takes no sibling's hold away
        view.release(other)
        assert table.withdraw(other, 0.0)
    finally:
        view.close()
        table.close(0.0)

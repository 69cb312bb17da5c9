"""CrossMemoryEngine in one process: iovec batching, short counts, kernel refusals, races, deregistration, descriptors.

The syscalls are real unless a test puts a stand-in kernel in ``iovec.SYSCALLS`` (one that answers short,
refuses, or blocks until the test lets it go); every wait is bounded and no test reads the clock.
"""

import ctypes
import errno
import gc
import mmap
import os
import subprocess
import sys
import threading
import time
import weakref

import msgspec
import pytest
import torch

from moriio_fsm.engines import StatusCode
from moriio_fsm.engines.same_host import (
    CrossMemoryEngine,
    CrossMemoryEngineDesc,
    CrossMemoryError,
    CrossMemoryMemoryDesc,
    iovec,
)

from ..conftest import Pair

WAIT_MS = 10_000
SIZE = 1 << 16
PROT_NONE = 0  # <sys/mman.h>; Python's mmap module lacks it


@pytest.fixture
def cma():
    made = Pair("cross_memory", size=SIZE)
    yield made
    made.close()


@pytest.fixture
def split_cma(monkeypatch):
    """A pair whose producer splits every batch across two copy threads."""
    made = Pair("cross_memory", size=SIZE, copy_threads=2)
    monkeypatch.setattr(made.producer.tuning, "parallel_copy_min_bytes", 1)
    yield made
    made.close()


def iovecs(address: int, count: int):
    return (ctypes.c_size_t * (2 * count)).from_address(address)


class RecordingKernel:
    """The real syscall, with the iovec count of every call kept, moving at most ``limit`` bytes a call."""

    def __init__(self, op: str, limit: int | None = None):
        self.real = iovec.SYSCALLS[op]
        self.limit = limit
        self.counts: list[int] = []
        self.threads: set[str] = set()

    def __call__(self, pid, local_iov, remote_iov, count):
        self.counts.append(count)
        self.threads.add(threading.current_thread().name)
        if self.limit is None:
            return self.real(pid, local_iov, remote_iov, count)
        # Hand the kernel only the first ``limit`` bytes, cutting an iovec in two where needed:
        # what a real short count looks like to the caller.
        local, remote = iovecs(local_iov, count), iovecs(remote_iov, count)
        short_local, short_remote = (
            (ctypes.c_size_t * (2 * count))(),
            (ctypes.c_size_t * (2 * count))(),
        )
        left, used = self.limit, 0
        while used < count and left > 0:
            take = min(left, local[2 * used + 1])
            short_local[2 * used], short_local[2 * used + 1] = local[2 * used], take
            short_remote[2 * used], short_remote[2 * used + 1] = remote[2 * used], take
            left -= take
            used += 1
        return self.real(pid, ctypes.addressof(short_local), ctypes.addressof(short_remote), used)


class BlockingKernel:
    """The real syscall, but the first call waits until ``go`` is set (a copy caught in flight)."""

    def __init__(self, op: str):
        self.real = iovec.SYSCALLS[op]
        self.entered = threading.Event()
        self.go = threading.Event()
        self.order: list[str] = []

    def __call__(self, pid, local_iov, remote_iov, count):
        if not self.entered.is_set():
            self.entered.set()
            assert self.go.wait(WAIT_MS / 1000)
        moved = self.real(pid, local_iov, remote_iov, count)
        self.order.append("copied")
        return moved


def scattered(count: int, size: int, stride: int):
    """``count`` ranges of ``size`` bytes, written in reverse order so that none merge."""
    local = [i * size for i in range(count)]
    remote = [(count - 1 - i) * stride for i in range(count)]
    return local, remote, [size] * count


def landed(pair, local, remote, sizes):
    return all(
        torch.equal(pair.target[r : r + s], pair.source[lo : lo + s])
        for lo, r, s in zip(local, remote, sizes)
    )


# -- iovec batching and short counts ---------------------------------------------------


def test_a_batch_larger_than_iov_max_goes_in_several_calls_and_lands_whole(cma, monkeypatch):
    kernel = RecordingKernel("write")
    monkeypatch.setitem(iovec.SYSCALLS, "write", kernel)
    count = 2 * iovec.IOV_MAX + 300
    local, remote, sizes = scattered(count, 8, 24)
    status = cma.session.batch_write(local, remote, sizes, cma.session.allocate_transfer_uid())
    assert status.wait_for(WAIT_MS) and status.succeeded(), status.message()
    assert landed(cma, local, remote, sizes)
    assert kernel.counts == [iovec.IOV_MAX, iovec.IOV_MAX, 300]


@pytest.mark.parametrize("limit", [1, 1000, 4096, 5000])
def test_short_counts_are_continued_where_the_kernel_stopped(cma, monkeypatch, limit):
    kernel = RecordingKernel("write", limit=limit)
    monkeypatch.setitem(iovec.SYSCALLS, "write", kernel)
    local, remote, sizes = [0, 5000, 9000, 20000], [40000, 100, 30000, 9000], [4096, 3000, 17, 8192]
    status = cma.session.batch_write(local, remote, sizes, cma.session.allocate_transfer_uid())
    assert status.wait_for(WAIT_MS) and status.succeeded(), status.message()
    assert landed(cma, local, remote, sizes)
    assert len(kernel.counts) >= -(-sum(sizes) // limit)


def test_short_counts_of_a_read_across_iov_max_are_continued(cma, monkeypatch):
    monkeypatch.setitem(iovec.SYSCALLS, "read", RecordingKernel("read", limit=3333))
    cma.target[:] = torch.arange(SIZE, dtype=torch.int64).remainder(253).to(torch.uint8)
    count = iovec.IOV_MAX + 10
    local, remote, sizes = scattered(count, 16, 40)
    status = cma.session.batch_read(local, remote, sizes, cma.session.allocate_transfer_uid())
    assert status.wait_for(WAIT_MS) and status.succeeded(), status.message()
    assert landed(cma, local, remote, sizes)


def test_a_large_batch_split_across_copy_threads_lands_whole(split_cma, monkeypatch):
    kernel = RecordingKernel("write", limit=777)
    monkeypatch.setitem(iovec.SYSCALLS, "write", kernel)
    local, remote, sizes = scattered(iovec.IOV_MAX + 40, 32, 48)
    status = split_cma.session.batch_write(
        local, remote, sizes, split_cma.session.allocate_transfer_uid()
    )
    assert status.wait_for(WAIT_MS) and status.succeeded(), status.message()
    assert landed(split_cma, local, remote, sizes)
    assert len(kernel.threads) == 2, kernel.threads


def test_threads_copying_their_first_large_batch_at_once_share_one_pool_of_copy_helpers(
    split_cma, monkeypatch
):
    """Posting threads that copy inline and the worker can all reach the first split copy
    together: each pool made would start threads of its own that nothing shuts down."""
    engine = split_cma.producer
    from moriio_fsm.engines import copy_split

    pools = []
    real_pool = copy_split.ThreadPoolExecutor

    def counted(*args, **kwargs):
        time.sleep(0.02)  # a slow start widens the window between check and make
        pools.append(real_pool(*args, **kwargs))
        return pools[-1]

    monkeypatch.setattr(copy_split, "ThreadPoolExecutor", counted)
    local, remote, sizes = scattered(64, 32, 48)
    start, errors = threading.Barrier(8), []

    def copy():
        start.wait()
        try:
            engine._pages.move(
                "write",
                None,
                split_cma.source.data_ptr(),
                split_cma.target.data_ptr(),
                local,
                remote,
                sizes,
                sum(sizes),
            )
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=copy) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == [] and len(pools) == 1
    assert landed(split_cma, local, remote, sizes)


def test_a_refusal_in_the_second_copy_thread_names_the_range_of_the_whole_batch(
    split_cma, monkeypatch
):
    cma = split_cma
    real = iovec.SYSCALLS["write"]

    def refuse_the_second_half(pid, local_iov, remote_iov, count):
        first_local = iovecs(local_iov, count)[0]
        if first_local >= cma.source.data_ptr() + 32 * 64:
            return -errno.EFAULT
        return real(pid, local_iov, remote_iov, count)

    monkeypatch.setitem(iovec.SYSCALLS, "write", refuse_the_second_half)
    local, remote, sizes = scattered(128, 32, 48)
    status = cma.session.batch_write(local, remote, sizes, cma.session.allocate_transfer_uid())
    assert status.wait_for(WAIT_MS) and status.code() == StatusCode.ERR_RDMA_OP
    assert "at range 64 (after 2048 bytes)" in status.message(), status.message()


def test_a_kernel_that_makes_no_progress_fails_the_batch_instead_of_spinning(cma, monkeypatch):
    monkeypatch.setitem(iovec.SYSCALLS, "write", lambda pid, local, remote, count: 0)
    status = cma.session.write(0, 0, 64, cma.session.allocate_transfer_uid())
    assert status.wait_for(WAIT_MS) and status.code() == StatusCode.ERR_RDMA_OP
    assert "EFAULT" in status.message()


def test_an_interrupted_call_is_retried(cma, monkeypatch):
    real, calls = iovec.SYSCALLS["write"], []

    def interrupted_once(pid, local, remote, count):
        calls.append(count)
        return -errno.EINTR if len(calls) == 1 else real(pid, local, remote, count)

    monkeypatch.setitem(iovec.SYSCALLS, "write", interrupted_once)
    status = cma.session.write(0, 100, 64, cma.session.allocate_transfer_uid())
    assert status.wait_for(WAIT_MS) and status.succeeded()
    assert torch.equal(cma.target[100:164], cma.source[:64]) and len(calls) == 2


def test_a_real_partial_transfer_into_an_unmapped_page_fails_naming_the_range():
    """The kernel itself answers short: range 0 lands, range 1 meets a PROT_NONE page (EFAULT)."""
    page = mmap.PAGESIZE
    region = mmap.mmap(-1, 3 * page)
    target = torch.frombuffer(region, dtype=torch.uint8)
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.mprotect(ctypes.c_void_p(target.data_ptr() + page), page, PROT_NONE) == 0
    producer, consumer = CrossMemoryEngine("partial-p"), CrossMemoryEngine("partial-d")
    try:
        producer.register_remote_engine(consumer.get_engine_desc())
        source = torch.full((3 * page,), 9, dtype=torch.uint8)
        session = producer.create_session(
            producer.register_torch_tensor(source), consumer.register_torch_tensor(target)
        )
        status = session.batch_write(
            [0, page], [0, page], [page, page], session.allocate_transfer_uid()
        )
        assert status.wait_for(WAIT_MS) and status.code() == StatusCode.ERR_RDMA_OP
        assert "range 1" in status.message() and "EFAULT" in status.message()
        assert int(target[:page].min()) == 9  # range 0 had landed before the fault
    finally:
        producer.close()
        consumer.close()
        libc.mprotect(
            ctypes.c_void_p(target.data_ptr() + page), page, mmap.PROT_READ | mmap.PROT_WRITE
        )
        del target, session
        region.close()


# -- kernel refusals -----------------------------------------------------------------


def test_eperm_becomes_a_failed_status_saying_why_and_what_allows_it(cma, monkeypatch):
    monkeypatch.setitem(iovec.SYSCALLS, "write", lambda pid, local, remote, count: -errno.EPERM)
    status = cma.session.write(0, 0, 64, cma.session.allocate_transfer_uid())
    assert status.wait_for(WAIT_MS) and status.code() == StatusCode.ERR_RDMA_OP
    message = status.message()
    for needed in (
        "EPERM",
        "ptrace permission",
        "kernel.yama.ptrace_scope",
        "CAP_SYS_PTRACE",
        "same user",
    ):
        assert needed in message, message
    assert int(cma.target.count_nonzero()) == 0


@pytest.mark.parametrize(
    "scope, advice",
    [
        (None, "same user (without Yama nothing else is needed)"),
        ("0", "same user with kernel.yama.ptrace_scope = 0"),
        ("1", "allow_same_user_peers=True"),
        ("2", "only a process with CAP_SYS_PTRACE may attach"),
        ("3", "no process may attach until the next reboot"),
    ],
)
def test_the_eperm_advice_follows_the_ptrace_scope(monkeypatch, scope, advice):
    real = iovec._read_first_line
    monkeypatch.setattr(
        iovec,
        "_read_first_line",
        lambda path: scope if path.endswith("ptrace_scope") else real(path),
    )
    assert advice in iovec.refusal_text(errno.EPERM, os.getpid(), "write")


def test_an_engine_that_lets_same_user_peers_attach_still_works():
    with CrossMemoryEngine("open-door", allow_same_user_peers=True) as engine:
        tensor = torch.zeros(64, dtype=torch.uint8)
        mem = engine.register_torch_tensor(tensor)
        session = engine.create_session(mem, mem)
        assert session.alive()


def test_esrch_says_the_peer_is_gone(cma, monkeypatch):
    monkeypatch.setitem(iovec.SYSCALLS, "read", lambda pid, local, remote, count: -errno.ESRCH)
    status = cma.session.read(0, 0, 64, cma.session.allocate_transfer_uid())
    assert status.wait_for(WAIT_MS) and status.code() == StatusCode.ERR_RDMA_OP
    assert "gone (ESRCH)" in status.message()


# -- threads ---------------------------------------------------------------------------


def test_threads_racing_posts_all_land(cma):
    threads, per_thread, size = 8, 32, 64
    statuses: list = []
    start = threading.Barrier(threads)

    def post(index):
        start.wait()
        for n in range(per_thread):
            offset = (index * per_thread + n) * size
            statuses.append(
                cma.session.batch_write(
                    [offset], [SIZE - size - offset], [size], cma.session.allocate_transfer_uid()
                )
            )

    workers = [threading.Thread(target=post, args=(i,)) for i in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    assert len(statuses) == threads * per_thread
    assert cma.producer.wait_all(statuses, WAIT_MS) and all(s.succeeded() for s in statuses)
    total = threads * per_thread * size
    assert torch.equal(
        cma.target[SIZE - total :].flip(0).view(-1, size).flip(1).reshape(-1), cma.source[:total]
    )


@pytest.mark.parametrize("kind", ["cross_memory", "cross_memory_inline"])
def test_posts_racing_close_all_end_final(kind):
    # Rounds, because the window is narrow: a batch the worker (or an inline poster) already
    # took when close began must end as close ends the queued ones, never as a copy failure.
    for _ in range(15):
        pair = Pair(kind, size=SIZE)
        statuses: list = []
        posting, closed = threading.Event(), threading.Event()

        def post():
            # Posts until a few after close returned: a fixed count could all go before the
            # closing thread got its turn, and then no post would race close at all.
            after_close = 0
            for n in range(1_000_000):
                session = pair.session  # noqa: B023 (called within this iteration)
                uid = session.allocate_transfer_uid()
                statuses.append(session.write(n * 64 % SIZE, 0, 64, uid))  # noqa: B023 (likewise)
                posting.set()  # noqa: B023 (called within this iteration)
                if closed.is_set():  # noqa: B023 (called within this iteration)
                    after_close += 1
                    if after_close >= 3:
                        break

        poster = threading.Thread(target=post)
        poster.start()
        try:
            assert posting.wait(WAIT_MS / 1000)
            pair.producer.close()
        finally:
            closed.set()
            poster.join()
        try:
            assert pair.producer.wait_all(statuses, WAIT_MS)
            wrong = [
                (s.code(), s.message())
                for s in statuses
                if not (s.succeeded() or s.code() == StatusCode.ERR_BAD_STATE)
            ]
            assert not wrong, wrong[:3]
            assert statuses[-1].code() == StatusCode.ERR_BAD_STATE
        finally:
            pair.close()


# -- deregistration --------------------------------------------------------------------


@pytest.mark.parametrize("side", ["remote", "local"])
def test_deregistration_waits_for_the_copy_in_flight_then_later_transfers_fail(
    cma, monkeypatch, side
):
    kernel = BlockingKernel("write")
    monkeypatch.setitem(iovec.SYSCALLS, "write", kernel)
    in_flight = cma.session.write(0, 0, 128, cma.session.allocate_transfer_uid())
    assert kernel.entered.wait(WAIT_MS / 1000)
    owner, mem = (
        (cma.consumer, cma.target_mem) if side == "remote" else (cma.producer, cma.source_mem)
    )

    def deregister():
        owner.deregister_memory(mem)
        kernel.order.append("deregistered")

    deregistering = threading.Thread(target=deregister)
    deregistering.start()
    deregistering.join(0.5)
    assert deregistering.is_alive(), (
        "deregister_memory returned while a copy into the memory was in flight"
    )
    kernel.go.set()
    deregistering.join(WAIT_MS / 1000)
    assert kernel.order == ["copied", "deregistered"]
    assert in_flight.wait_for(WAIT_MS) and in_flight.succeeded()
    cma.target.zero_()
    later = cma.session.write(0, 0, 128, cma.session.allocate_transfer_uid())
    assert later.wait_for(WAIT_MS) and later.code() == StatusCode.ERR_RDMA_OP
    assert f"{side} memory" in later.message() and "deregistered" in later.message()
    assert int(cma.target.count_nonzero()) == 0
    assert not cma.session.alive()


def test_a_held_transfer_released_after_deregistration_moves_nothing(cma):
    hold = cma.producer.faults.hold_nth(1)
    queued = cma.session.write(0, 0, 256, cma.session.allocate_transfer_uid())
    cma.consumer.deregister_memory(cma.target_mem)
    hold.release()
    assert queued.wait_for(WAIT_MS) and queued.code() == StatusCode.ERR_RDMA_OP
    assert int(cma.target.count_nonzero()) == 0


def test_memory_a_stopped_peer_still_copies_into_stays_allocated_after_the_wait(monkeypatch):
    kernel = BlockingKernel("write")
    monkeypatch.setitem(iovec.SYSCALLS, "write", kernel)
    producer = CrossMemoryEngine("stuck-p")
    consumer = CrossMemoryEngine("stuck-d", deregister_wait_s=0.05)
    try:
        producer.register_remote_engine(consumer.get_engine_desc())
        target = torch.zeros(4096, dtype=torch.uint8)
        still_there = weakref.ref(target)
        target_mem = consumer.register_torch_tensor(target)
        source = torch.ones(4096, dtype=torch.uint8)
        session = producer.create_session(producer.register_torch_tensor(source), target_mem)
        in_flight = session.write(0, 0, 4096, session.allocate_transfer_uid())
        assert kernel.entered.wait(WAIT_MS / 1000)
        consumer.deregister_memory(target_mem)  # gives up waiting: the copy is stuck
        del target
        gc.collect()
        assert still_there() is not None, "memory a copy was still in flight into was freed"
        kernel.go.set()
        assert in_flight.wait_for(WAIT_MS) and in_flight.succeeded()
        assert int(still_there().min()) == 1
        later = session.write(0, 0, 64, session.allocate_transfer_uid())
        assert later.wait_for(WAIT_MS) and later.failed()
    finally:
        kernel.go.set()
        producer.close()
        consumer.close()


def test_closing_the_remote_engine_fails_later_transfers(cma):
    cma.consumer.close()
    status = cma.session.write(0, 0, 64, cma.session.allocate_transfer_uid())
    assert status.wait_for(WAIT_MS) and status.code() == StatusCode.ERR_RDMA_OP
    assert int(cma.target.count_nonzero()) == 0


def test_a_deregistered_remote_engine_fails_its_sessions(cma):
    cma.producer.deregister_remote_engine(cma.consumer.get_engine_desc())
    assert not cma.session.alive()
    status = cma.session.write(0, 0, 64, cma.session.allocate_transfer_uid())
    assert status.wait_for(WAIT_MS) and "deregistered" in status.message()


# -- descriptors and registration ------------------------------------------------------


def test_a_session_into_this_engines_own_memory_works(cma):
    other = torch.zeros(1024, dtype=torch.uint8)
    session = cma.producer.create_session(cma.source_mem, cma.producer.register_torch_tensor(other))
    status = session.write(10, 20, 100, session.allocate_transfer_uid())
    assert status.wait_for(WAIT_MS) and status.succeeded()
    assert torch.equal(other[20:120], cma.source[10:110])


@pytest.mark.parametrize("field, change", [("address", 8), ("size", 8), ("mem_id", 1), ("slot", 1)])
def test_an_altered_memory_descriptor_reaches_nothing(cma, field, change):
    altered = msgspec.structs.replace(
        cma.remote_mem, **{field: getattr(cma.remote_mem, field) + change}
    )
    assert cma.producer.create_session(cma.source_mem, altered) is None


def test_descriptors_from_another_host_or_pid_namespace_are_refused_naming_both(cma):
    desc = cma.consumer.get_engine_desc()
    with pytest.raises(CrossMemoryError, match=f"another host.*{desc.boot_id[:8]}"):
        cma.producer.register_remote_engine(
            msgspec.structs.replace(desc, key="far", boot_id="0" * 36)
        )
    with pytest.raises(CrossMemoryError, match=f"another pid namespace.*{desc.pid_namespace}"):
        cma.producer.register_remote_engine(
            msgspec.structs.replace(desc, key="boxed", pid_namespace=1)
        )


def test_a_descriptor_naming_a_process_that_is_not_the_engine_is_refused(cma):
    desc = cma.consumer.get_engine_desc()
    with pytest.raises(CrossMemoryError, match=f"process {os.getppid()}"):
        cma.producer.register_remote_engine(
            msgspec.structs.replace(desc, key="imposter", pid=os.getppid())
        )
    with pytest.raises(CrossMemoryError, match="not the registration table|not engine"):
        cma.producer.register_remote_engine(
            msgspec.structs.replace(desc, key="forged", token=bytes(16))
        )


def test_a_descriptor_of_an_exited_process_is_refused():
    done = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    with CrossMemoryEngine("survivor") as engine:
        desc = msgspec.structs.replace(engine.get_engine_desc(), key="ghost", pid=int(done.stdout))
        with pytest.raises(CrossMemoryError, match="gone|not engine"):
            engine.register_remote_engine(desc)


def test_malformed_descriptors_raise_value_or_type_errors(cma):
    engine = cma.producer
    for garbage in (
        b"",
        b"\x00\x01",
        msgspec.msgpack.encode({"type": "moriio-cma-engine"}),
        cma.target_mem.pack(),
    ):
        with pytest.raises(ValueError, match="engine descriptor"):
            engine.unpack_engine_desc(garbage)
    with pytest.raises(ValueError, match="memory descriptor"):
        engine.unpack_memory_desc(
            msgspec.msgpack.encode(msgspec.structs.replace(cma.target_mem, size=1))[:-3]
        )
    with pytest.raises(ValueError, match="size"):
        engine.unpack_memory_desc(
            msgspec.msgpack.encode(msgspec.structs.replace(cma.target_mem, size=0))
        )
    with pytest.raises(TypeError, match="bytes"):
        engine.unpack_memory_desc("not bytes")
    with pytest.raises(TypeError, match="CrossMemoryEngineDesc"):
        engine.register_remote_engine(object())


def test_only_contiguous_cpu_tensors_with_bytes_are_registered(cma):
    engine = cma.producer
    with pytest.raises(ValueError, match="contiguous"):
        engine.register_torch_tensor(torch.zeros(4, 6)[:, ::2])
    with pytest.raises(ValueError, match="host memory only"):
        engine.register_torch_tensor(torch.zeros(4, device="meta"))
    with pytest.raises(ValueError, match="empty"):
        engine.register_torch_tensor(torch.zeros(0))
    with pytest.raises(TypeError, match="torch.Tensor"):
        engine.register_torch_tensor(bytearray(8))


def test_a_registration_table_that_is_full_says_so():
    with CrossMemoryEngine("tiny", max_registrations=2) as engine:
        tensors = [torch.zeros(8) for _ in range(3)]
        first = engine.register_torch_tensor(tensors[0])
        engine.register_torch_tensor(tensors[1])
        with pytest.raises(RuntimeError, match="full: 2 tensors"):
            engine.register_torch_tensor(tensors[2])
        engine.deregister_memory(first)
        engine.register_torch_tensor(tensors[2])  # the freed slot is used again


def test_the_engine_descriptor_names_this_process_and_host(cma):
    desc = CrossMemoryEngineDesc.unpack(cma.consumer.get_engine_desc().pack())
    assert desc.pid == os.getpid() and desc.key == cma.consumer.key
    assert isinstance(CrossMemoryMemoryDesc.unpack(cma.target_mem.pack()), CrossMemoryMemoryDesc)


def test_sessions_on_many_threads_never_trip_over_the_peer_liveness_check(cma):
    """Posting from several threads at once (a forward thread and an I/O thread do) lands
    every batch; the peer's exit check must not refuse concurrent callers."""
    errors, statuses = [], []
    lock = threading.Lock()

    def post(offset):
        try:
            for _ in range(50):
                status = cma.session.batch_write(
                    [offset], [offset], [64], cma.session.allocate_transfer_uid()
                )
                with lock:
                    statuses.append(status)
                cma.session.alive()
        except Exception as exc:  # noqa: BLE001 - any error is the failure under test
            errors.append(exc)

    threads = [threading.Thread(target=post, args=(i * 64,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not errors
    assert cma.producer.wait_all(statuses, WAIT_MS)
    assert all(status.code() == StatusCode.SUCCESS for status in statuses)
    assert torch.equal(cma.target[: 8 * 64], cma.source[: 8 * 64])

"""Shared pages: a registered tensor's whole pages moved onto a sealed memfd in place, and peers copying by memcpy.

What a user relies on: the tensor keeps its addresses and bytes; memory that is someone else's too (a file, shared
memory) is left alone; a peer copies into the pages without a kernel call, and ranges outside them still land by
the kernel; a forged or unsealed region is refused and the copy still lands; nothing outlives its registration.
"""

import ctypes
import fcntl
import logging
import mmap
import os
import subprocess
import sys
import tempfile
import textwrap
import threading

import msgspec
import pytest
import torch

from moriio_fsm.engines import StatusCode
from moriio_fsm.engines.same_host import CrossMemoryEngine, CrossMemoryMemoryDesc, iovec
from moriio_fsm.engines.same_host.shared_pages import ADOPTED_NAME_PREFIX, AdoptedPages, PeerPages
from moriio_fsm.engines.shared_memory import RegionUnavailable, SharedRegion

from ..conftest import Pair, page_aligned_zeros

PAGE = mmap.PAGESIZE
WAIT_MS = 10_000
SIZE = 16 * PAGE


def maps_lines(token: str) -> list[str]:
    with open("/proc/self/maps") as maps:
        return [line for line in maps if token in line]


def fds_naming(token: str) -> list[str]:
    found = []
    for name in os.listdir("/proc/self/fd"):
        try:
            if token in os.readlink(f"/proc/self/fd/{name}"):
                found.append(name)
        except OSError:
            pass
    return found


class NoKernel:
    """Stands in for process_vm_writev/readv and fails the test if a copy reaches the kernel."""

    def __init__(self):
        self.calls = 0

    def __call__(self, pid, local_iov, remote_iov, count):
        self.calls += 1
        raise AssertionError("a copy into shared pages went to the kernel")


class Counting:
    def __init__(self, real):
        self.real, self.calls = real, 0

    def __call__(self, pid, local_iov, remote_iov, count):
        self.calls += 1
        return self.real(pid, local_iov, remote_iov, count)


# -- adopting ------------------------------------------------------------------------


def test_adopting_keeps_every_address_and_byte_and_the_tensor_keeps_working():
    tensor = torch.randint(
        0, 1 << 30, (3 << 18,), dtype=torch.int32, generator=torch.Generator().manual_seed(1)
    )
    before, address, nbytes = tensor.clone(), tensor.data_ptr(), tensor.numel() * 4
    adopted = AdoptedPages.adopt(address, nbytes)
    try:
        assert adopted is not None
        assert tensor.data_ptr() == address and torch.equal(tensor, before)
        assert adopted.start % PAGE == 0 and address <= adopted.start
        assert (
            adopted.start + adopted.size <= address + nbytes and adopted.size >= nbytes - 2 * PAGE
        )
        assert any("rw-s" in line for line in maps_lines(adopted.token))
        # Both ways: a peer's mapping and the tensor are the same memory.
        peer = PeerPages(os.getpid(), adopted.fd, adopted.token, adopted.size, adopted.start)
        mapped = torch.frombuffer(
            (ctypes.c_char * adopted.size).from_address(peer.address), dtype=torch.uint8
        )
        skip = (adopted.start - address) // 4
        mapped[:8] = 0xFF
        assert tensor[skip : skip + 2].tolist() == [-1, -1]
        tensor[skip + 100] = 1234
        assert mapped[400:404].view(torch.int32).item() == 1234
        tensor.add_(1)  # the tensor still works as before: torch ops over moved pages
        assert mapped[400:404].view(torch.int32).item() == 1235
        kept = tensor.clone()
    finally:
        assert adopted.give_back()
    # Given back: private memory again, same bytes, no fd, and the peer's old mapping no longer aliases it.
    assert (
        fds_naming(adopted.token) == [] and maps_lines(adopted.token) != []
    )  # only the peer's mapping
    assert tensor.data_ptr() == address and torch.equal(tensor, kept)
    assert not any(
        line.split()[1] == "rw-s"
        and int(line.split("-")[0], 16) <= adopted.start < int(line.split()[0].split("-")[1], 16)
        for line in open("/proc/self/maps")
    )
    mapped[400:404] = 0
    assert tensor[skip + 100].item() == 1235
    del mapped, peer
    assert maps_lines(adopted.token) == []


def test_an_adopted_region_cannot_change_size_so_a_peers_copy_never_faults():
    tensor = page_aligned_zeros(4 * PAGE)
    adopted = AdoptedPages.adopt(tensor.data_ptr(), 4 * PAGE)
    try:
        assert adopted.size == 4 * PAGE
        for size in (0, PAGE, 8 * PAGE):
            with pytest.raises(PermissionError):
                os.ftruncate(adopted.fd, size)
    finally:
        adopted.give_back()


def test_memory_that_is_someone_elses_too_or_holds_no_whole_page_is_not_adopted():
    region, shared = SharedRegion.allocate(8 * PAGE)  # shared memory: a peer may map it already
    assert AdoptedPages.adopt(shared.data_ptr(), 8 * PAGE) is None
    with tempfile.TemporaryFile() as backing:  # a file's pages belong to the file
        backing.truncate(8 * PAGE)
        file_map = mmap.mmap(backing.fileno(), 8 * PAGE)
        on_file = torch.frombuffer(file_map, dtype=torch.uint8)
        assert AdoptedPages.adopt(on_file.data_ptr(), 8 * PAGE) is None
        del on_file
        file_map.close()
    small = page_aligned_zeros(3 * PAGE)[
        100 : 100 + PAGE
    ]  # straddles two pages, holds neither whole
    assert AdoptedPages.adopt(small.data_ptr(), PAGE) is None
    twice = page_aligned_zeros(2 * PAGE)
    first = AdoptedPages.adopt(twice.data_ptr(), 2 * PAGE)
    try:
        assert first is not None and AdoptedPages.adopt(twice.data_ptr(), 2 * PAGE) is None
    finally:
        first.give_back()
    region.close()


# -- copying --------------------------------------------------------------------------


@pytest.mark.parametrize("inline", [False, True], ids=["worker", "inline"])
def test_copies_into_and_out_of_shared_pages_are_memory_copies_not_kernel_calls(
    monkeypatch, inline
):
    pair = Pair("cross_memory_shared", size=SIZE, inline_copies=inline)
    try:
        assert pair.target_mem.shares_pages and pair.session.mapped_remote_address is not None
        kernel = NoKernel()
        monkeypatch.setitem(iovec.SYSCALLS, "write", kernel)
        monkeypatch.setitem(iovec.SYSCALLS, "read", kernel)
        writes = [
            pair.session.write(
                n * PAGE, (15 - n) * PAGE, PAGE, pair.session.allocate_transfer_uid()
            )
            for n in range(8)
        ]
        assert pair.producer.wait_all(writes, WAIT_MS) and all(s.succeeded() for s in writes)
        for n in range(8):
            assert torch.equal(
                pair.target[(15 - n) * PAGE : (16 - n) * PAGE],
                pair.source[n * PAGE : (n + 1) * PAGE],
            )
        pair.target[3 * PAGE : 4 * PAGE] = 77
        read = pair.session.read(10 * PAGE, 3 * PAGE, PAGE, pair.session.allocate_transfer_uid())
        assert read.wait_for(WAIT_MS) and read.succeeded(), read.message()
        assert bool((pair.source[10 * PAGE : 11 * PAGE] == 77).all())
        assert kernel.calls == 0
    finally:
        pair.close()


def test_ranges_outside_the_shared_pages_go_by_the_kernel_and_land_too(monkeypatch):
    with (
        CrossMemoryEngine("pages-writer") as writer,
        CrossMemoryEngine("pages-owner", share_pages=True) as owner,
    ):
        writer.register_remote_engine(writer.unpack_engine_desc(owner.get_engine_desc().pack()))
        target = page_aligned_zeros(SIZE + 2 * PAGE)[
            100 : 100 + SIZE
        ]  # partial first and last pages
        remote = writer.unpack_memory_desc(owner.register_torch_tensor(target).pack())
        assert (
            remote.shared_start == target.data_ptr() - 100 + PAGE
            and remote.shared_size == (SIZE // PAGE - 1) * PAGE
        )
        source = torch.randint(
            0, 256, (SIZE,), dtype=torch.uint8, generator=torch.Generator().manual_seed(2)
        )
        session = writer.create_session(writer.register_torch_tensor(source), remote)
        kernel = Counting(iovec.SYSCALLS["write"])
        monkeypatch.setitem(iovec.SYSCALLS, "write", kernel)
        inside = session.write(0, 2 * PAGE, PAGE, session.allocate_transfer_uid())
        assert inside.wait_for(WAIT_MS) and inside.succeeded() and kernel.calls == 0
        for offset in (0, SIZE - 64):  # the head's and the tail's partial pages
            edge = session.write(offset, offset, 64, session.allocate_transfer_uid())
            assert edge.wait_for(WAIT_MS) and edge.succeeded(), edge.message()
        assert kernel.calls == 2
        assert torch.equal(target[2 * PAGE : 3 * PAGE], source[:PAGE])
        assert torch.equal(target[:64], source[:64]) and torch.equal(
            target[SIZE - 64 :], source[SIZE - 64 :]
        )


def test_threads_writing_disjoint_ranges_into_shared_pages_all_land():
    pair = Pair("cross_memory_shared", size=SIZE)
    try:
        statuses, lock = [], threading.Lock()

        def write(thread: int):
            for n in range(thread, 64, 4):
                status = pair.session.write(
                    n * 1024, SIZE - (n + 1) * 1024, 1024, pair.session.allocate_transfer_uid()
                )
                with lock:
                    statuses.append(status)

        workers = [threading.Thread(target=write, args=(t,)) for t in range(4)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        assert pair.producer.wait_all(statuses, WAIT_MS) and all(s.succeeded() for s in statuses)
        for n in range(64):
            assert torch.equal(
                pair.target[SIZE - (n + 1) * 1024 : SIZE - n * 1024],
                pair.source[n * 1024 : (n + 1) * 1024],
            )
    finally:
        pair.close()


# -- hostile and stale regions --------------------------------------------------------------


def _forged(desc: CrossMemoryMemoryDesc, **fields) -> bytes:
    raw = msgspec.structs.asdict(desc) | fields
    return msgspec.msgpack.encode({"type": "moriio-cma-memory", **raw})


@pytest.mark.parametrize(
    "fields, named",
    [
        ({"shared_start": 0}, "outside"),
        ({"shared_size": 1 << 40}, "outside"),
        ({"shared_start": "ALIGN+1"}, "page-aligned"),
        ({"shared_token": ""}, "token"),
        ({"shared_token": "../etc"}, "shared_token"),
        ({"shared_fd": -1}, "shared_fd is -1"),
        ({"shared_fd": -7}, "shared_fd is -1"),
    ],
)
def test_a_memory_descriptor_with_impossible_shared_pages_is_refused_naming_the_fault(
    fields, named
):
    pair = Pair("cross_memory_shared", size=SIZE)
    try:
        desc = pair.target_mem
        if fields.get("shared_start") == "ALIGN+1":
            fields = {"shared_start": desc.shared_start + 1}
        with pytest.raises(ValueError, match="memory descriptor") as refused:
            pair.producer.unpack_memory_desc(_forged(desc, **fields))
        assert named in str(refused.value)
    finally:
        pair.close()


def test_an_unsealed_or_stale_region_is_not_mapped_and_the_copy_still_lands(caplog):
    caplog.set_level(
        logging.DEBUG, logger="moriio_fsm.engines.same_host.peers"
    )  # the repeat is debug
    pair = Pair("cross_memory_shared", size=SIZE)
    unsealed = os.memfd_create(ADOPTED_NAME_PREFIX + "0123456789abcdef", os.MFD_CLOEXEC)
    try:
        os.ftruncate(unsealed, pair.target_mem.shared_size)
        stale_fd = os.open("/dev/null", os.O_RDONLY)  # an fd that names something else
        forgeries = [
            (dict(shared_fd=unsealed, shared_token="0123456789abcdef"), "not sealed"),
            (dict(shared_fd=stale_fd), "closed shared region"),
        ]
        for fields, said in forgeries:
            remote = pair.producer.unpack_memory_desc(_forged(pair.target_mem, **fields))
            session = pair.producer.create_session(pair.source_mem, remote)
            assert session is not None and session.mapped_remote_address is None
            assert said in caplog.text and "the kernel copies" in caplog.text
            pair.target.zero_()
            status = session.write(0, PAGE, PAGE, session.allocate_transfer_uid())
            assert status.wait_for(WAIT_MS) and status.succeeded(), status.message()
            assert torch.equal(pair.target[PAGE : 2 * PAGE], pair.source[:PAGE])
        # One warning for the memory, however often its pages are refused.
        warned = [
            r
            for r in caplog.records
            if "cannot be mapped" in r.getMessage() and r.levelno >= logging.WARNING
        ]
        assert len(warned) == 1
        os.close(stale_fd)
    finally:
        os.close(unsealed)
        pair.close()


def test_deregistered_shared_memory_takes_no_copy_and_its_region_closes():
    pair = Pair("cross_memory_shared", size=SIZE)
    try:
        token = pair.target_mem.shared_token
        assert len(fds_naming(token)) == 1
        landed = pair.session.write(0, 0, PAGE, pair.session.allocate_transfer_uid())
        assert landed.wait_for(WAIT_MS) and landed.succeeded()
        pair.consumer.deregister_memory(pair.target_mem)
        assert fds_naming(token) == []  # no new peer can map it
        # The tensor is the owner's private memory again and kept what had landed.
        assert len(maps_lines(token)) == 1 and torch.equal(pair.target[:PAGE], pair.source[:PAGE])
        status = pair.session.write(PAGE, PAGE, PAGE, pair.session.allocate_transfer_uid())
        assert status.wait_for(WAIT_MS) and status.code() == StatusCode.ERR_RDMA_OP
        assert "deregistered" in status.message()
        assert int(pair.target[PAGE:].count_nonzero()) == 0
    finally:
        pair.close()


def test_a_peer_lets_go_of_its_mapping_of_memory_the_owner_no_longer_registers():
    pair = Pair("cross_memory_shared", size=SIZE)
    try:
        old_token = pair.target_mem.shared_token
        assert len(maps_lines(old_token)) == 2  # the owner's tensor and the producer's mapping
        pair.consumer.deregister_memory(pair.target_mem)
        assert len(maps_lines(old_token)) == 1  # the owner's tensor is private memory again
        pair.session = None
        fresh = page_aligned_zeros(SIZE)
        remote = pair.producer.unpack_memory_desc(pair.consumer.register_torch_tensor(fresh).pack())
        session = pair.producer.create_session(pair.source_mem, remote)
        assert session.mapped_remote_address is not None
        assert maps_lines(old_token) == []  # the producer let go of the old pages
        status = session.write(0, 0, PAGE, session.allocate_transfer_uid())
        assert (
            status.wait_for(WAIT_MS)
            and status.succeeded()
            and torch.equal(fresh[:PAGE], pair.source[:PAGE])
        )
    finally:
        pair.close()


# -- what an attacker or an unlucky process does -------------------------------------------


def run_python(code: str) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter (a crash there is a return code here, not a dead test run)."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=os.path.dirname(__file__),
    )


def test_an_interpreter_that_exits_without_closing_while_copies_run_exits_cleanly():
    done = run_python("""
        import threading, torch
        from moriio_fsm.engines.same_host import CrossMemoryEngine
        writer, owner = CrossMemoryEngine("w", inline_copies=False), CrossMemoryEngine("o", share_pages=True)
        writer.register_remote_engine(writer.unpack_engine_desc(owner.get_engine_desc().pack()))
        target = torch.zeros(64 << 20, dtype=torch.uint8)
        remote = writer.unpack_memory_desc(owner.register_torch_tensor(target).pack())
        session = writer.create_session(writer.register_torch_tensor(torch.ones(64 << 20, dtype=torch.uint8)), remote)
        assert session.mapped_remote_address is not None
        def flood():
            while True:
                session.write(0, 4096, (64 << 20) - 8192, session.allocate_transfer_uid())
        threading.Thread(target=flood, daemon=True).start()
        import time; time.sleep(0.3)
        print("exiting")
    """)
    assert done.returncode == 0 and "exiting" in done.stdout, (done.returncode, done.stderr[-2000:])


def test_a_registration_overlapping_shared_pages_loses_no_write_when_the_adopter_goes():
    with (
        CrossMemoryEngine("ov-writer") as writer,
        CrossMemoryEngine("ov-a", share_pages=True) as first,
        CrossMemoryEngine("ov-b", share_pages=True) as second,
    ):
        for owner in (first, second):
            writer.register_remote_engine(writer.unpack_engine_desc(owner.get_engine_desc().pack()))
        target = page_aligned_zeros(SIZE)
        adopter = first.register_torch_tensor(target)
        overlapping = second.register_torch_tensor(target[PAGE:])  # same pages: not adopted twice
        assert adopter.shares_pages and not overlapping.shares_pages
        source = torch.randint(
            1, 256, (SIZE,), dtype=torch.uint8, generator=torch.Generator().manual_seed(4)
        )
        session = writer.create_session(
            writer.register_torch_tensor(source), writer.unpack_memory_desc(overlapping.pack())
        )
        statuses, stop = [], threading.Event()

        def write():
            n = 0
            while not stop.is_set() or n < 64:
                chunk = n % 15
                statuses.append(
                    (
                        chunk,
                        session.write(
                            chunk * PAGE, chunk * PAGE, PAGE, session.allocate_transfer_uid()
                        ),
                    )
                )
                n += 1

        thread = threading.Thread(target=write)
        thread.start()
        first.deregister_memory(adopter)  # the overlapping registration still covers the pages
        stop.set()
        thread.join()
        assert writer.wait_all([s for _, s in statuses], WAIT_MS)
        landed = {chunk for chunk, status in statuses if status.succeeded()}
        assert len(landed) == 15
        for chunk in landed:
            assert torch.equal(
                target[PAGE + chunk * PAGE : PAGE + (chunk + 1) * PAGE],
                source[chunk * PAGE : (chunk + 1) * PAGE],
            ), chunk
        assert any(
            "rw-s" in line for line in maps_lines(adopter.shared_token)
        )  # kept for the other one
        second.deregister_memory(overlapping)
        assert not any(
            "rw-s" in line and target.data_ptr() == int(line.split("-")[0], 16)
            for line in maps_lines(adopter.shared_token)
        )


def test_two_threads_registering_the_same_memory_at_once_adopt_it_once():
    for _ in range(5):
        target = page_aligned_zeros(SIZE)
        engines = [CrossMemoryEngine(f"race-{n}", share_pages=True) for n in range(2)]
        try:
            barrier, descs = threading.Barrier(2), []

            def register(engine):
                barrier.wait()  # noqa: B023 (called within this iteration)
                descs.append(engine.register_torch_tensor(target))  # noqa: B023 (called within this iteration)

            threads = [threading.Thread(target=register, args=(engine,)) for engine in engines]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            assert sorted(desc.shares_pages for desc in descs) == [False, True]
        finally:
            for engine in engines:
                engine.close()


def test_a_forked_child_does_not_inherit_the_shared_pages():
    with CrossMemoryEngine("fork-owner", share_pages=True) as owner:
        target = page_aligned_zeros(SIZE)
        desc = owner.register_torch_tensor(target)
        read, write = os.pipe()
        child = os.fork()
        if child == 0:  # the child reports what it maps, then leaves at once
            os.close(read)
            mapped = any(desc.shared_token in line for line in open("/proc/self/maps"))
            os.write(write, b"mapped" if mapped else b"absent")
            os._exit(0)
        os.close(write)
        answer = os.read(read, 16)
        os.close(read)
        os.waitpid(child, 0)
        assert answer == b"absent"


def test_pages_that_cannot_go_back_to_private_memory_keep_every_byte_and_are_never_freed(
    monkeypatch, caplog
):
    from moriio_fsm.engines.same_host import registrations, shared_pages

    def refuse(fd, start, offset, size):
        raise OSError(12, "refused for the test")

    with CrossMemoryEngine("stuck-owner", share_pages=True) as owner:
        target = page_aligned_zeros(SIZE)
        target.copy_(torch.arange(SIZE, dtype=torch.int64).remainder(251).to(torch.uint8))
        kept = target.clone()
        desc = owner.register_torch_tensor(target)
        monkeypatch.setattr(shared_pages, "_move_onto_private", refuse)
        owner.deregister_memory(desc)
        assert torch.equal(target, kept)
        assert any(t is target for t in registrations._lingering)  # never freed while still shared
        assert "back onto private memory" in caplog.text


def test_memory_freed_under_its_registration_is_deregistered_without_a_crash():
    done = run_python("""
        import torch
        from moriio_fsm.engines.same_host import CrossMemoryEngine
        with CrossMemoryEngine("freed", share_pages=True) as owner:
            target = torch.zeros(8 << 20, dtype=torch.uint8)
            desc = owner.register_torch_tensor(target)
            assert desc.shares_pages
            target.untyped_storage().resize_(0)     # the caller frees the memory it registered
            owner.deregister_memory(desc)
        print("deregistered")
    """)
    assert done.returncode == 0 and "deregistered" in done.stdout, (
        done.returncode,
        done.stderr[-2000:],
    )


def test_a_read_into_read_only_memory_fails_with_a_status_not_a_crash():
    done = run_python("""
        import ctypes, mmap, torch
        from moriio_fsm.engines.same_host import CrossMemoryEngine
        reader, owner = CrossMemoryEngine("ro-reader"), CrossMemoryEngine("ro-owner", share_pages=True)
        reader.register_remote_engine(reader.unpack_engine_desc(owner.get_engine_desc().pack()))
        remote = reader.unpack_memory_desc(owner.register_torch_tensor(torch.ones(1 << 20, dtype=torch.uint8)).pack())
        assert remote.shares_pages
        libc = ctypes.CDLL(None); libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        address = libc.mmap(None, 1 << 20, mmap.PROT_READ, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
        local = torch.frombuffer((ctypes.c_char * (1 << 20)).from_address(address), dtype=torch.uint8)
        session = reader.create_session(reader.register_torch_tensor(local), remote)
        assert session.mapped_remote_address is None    # its local side is no plain memory
        status = session.read(0, 8192, 4096, session.allocate_transfer_uid())
        status.wait_for(10_000)
        print("code", status.code(), status.message())
        reader.close(); owner.close()
    """)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert f"code {int(StatusCode.ERR_RDMA_OP)}" in done.stdout and "EFAULT" in done.stdout, (
        done.stdout
    )


def test_a_descriptor_pointing_at_another_registrations_pages_is_refused(caplog):
    pair = Pair("cross_memory_shared", size=SIZE)
    try:
        other = page_aligned_zeros(SIZE)
        other_desc = pair.consumer.register_torch_tensor(other)
        forged = pair.producer.unpack_memory_desc(
            _forged(
                pair.target_mem,
                shared_fd=other_desc.shared_fd,
                shared_token=other_desc.shared_token,
            )
        )
        session = pair.producer.create_session(pair.source_mem, forged)
        assert session is not None and session.mapped_remote_address is None
        assert "is not mapped at" in caplog.text
        status = session.write(0, 0, PAGE, session.allocate_transfer_uid())
        assert status.wait_for(WAIT_MS) and status.succeeded()
        assert (
            torch.equal(pair.target[:PAGE], pair.source[:PAGE]) and int(other.count_nonzero()) == 0
        )
    finally:
        pair.close()


def test_a_region_not_backed_by_its_owners_memory_is_not_mapped():
    token = "00112233445566ff"
    sparse = os.memfd_create(ADOPTED_NAME_PREFIX + token, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(sparse, 1 << 30)  # 1 GiB that the owner never paid for
        fcntl.fcntl(sparse, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
        with pytest.raises(RegionUnavailable, match="not backed"):
            PeerPages(os.getpid(), sparse, token, 1 << 30, 0)
    finally:
        os.close(sparse)


def test_a_huge_page_region_is_not_mapped():
    token = "ffeeddccbbaa9988"
    try:
        huge = os.memfd_create(
            ADOPTED_NAME_PREFIX + token, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING | os.MFD_HUGETLB
        )
    except OSError as exc:
        pytest.skip(f"no huge-page memfd here: {exc}")
    try:
        try:
            os.ftruncate(huge, 2 << 20)
        except OSError as exc:
            pytest.skip(f"no huge pages to back a memfd: {exc}")
        with pytest.raises(RegionUnavailable, match="not an ordinary memfd"):
            PeerPages(os.getpid(), huge, token, 2 << 20, 0)
    finally:
        os.close(huge)


def test_memory_prepared_at_the_handshake_is_mapped_before_the_first_session():
    with (
        CrossMemoryEngine("prep-writer") as writer,
        CrossMemoryEngine("prep-owner", share_pages=True) as owner,
    ):
        remote = writer.unpack_memory_desc(
            owner.register_torch_tensor(page_aligned_zeros(SIZE)).pack()
        )
        writer.prepare_remote_memory(remote)  # peer not registered yet: nothing to map
        assert len(maps_lines(remote.shared_token)) == 1  # the owner's tensor only
        writer.register_remote_engine(writer.unpack_engine_desc(owner.get_engine_desc().pack()))
        writer.prepare_remote_memory(remote)
        assert (
            len(maps_lines(remote.shared_token)) == 2
        )  # the owner's tensor and the writer's mapping
        session = writer.create_session(
            writer.register_torch_tensor(torch.ones(SIZE, dtype=torch.uint8)), remote
        )
        assert session.mapped_remote_address is not None
        assert (
            len(maps_lines(remote.shared_token)) == 2
        )  # the session used that mapping, made no other
        with pytest.raises(TypeError):
            writer.prepare_remote_memory(b"not a descriptor")

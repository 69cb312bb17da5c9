"""Copy assist against writers that misbehave: one that resizes the board, one that dies with jobs on it,
one that announces registrations by the thousand.

What a user relies on: no writer can make the board fault the destination's serving loop or another
writer; a writer that dies mid-job costs the board its slots only until the next sweep, and never a
live writer's slot; announcements, true or made up, cost each help call a bounded amount of work and
the destination a bounded amount of memory, and helping goes on after them.
"""

import ctypes
import fcntl
import logging
import mmap
import os
import secrets
import signal
import subprocess
import sys
import tracemalloc

import msgspec
import pytest
import torch

from moriio_fsm.engines import StatusCode
from moriio_fsm.engines.same_host import CrossMemoryEngine, CrossMemoryMemoryDesc, copy_assist
from moriio_fsm.engines.shared_memory import REGION_NAME_PREFIX, RegionUnavailable

from ..json_peer import JsonLinePeer

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(
        not copy_assist.available(), reason="the native copy-assist module was not built"
    ),
]

_native = copy_assist._copy_assist
RANGE = 128 << 10
BOARD_PEER = os.path.join(os.path.dirname(__file__), "board_peer.py")


@pytest.fixture
def board():
    """A board, a destination window (mem 7) over ``target`` and a source window (this pid, mem 3) over ``source``."""
    owner = copy_assist.AssistBoard(CrossMemoryMemoryDesc.unpack)
    generator = torch.Generator().manual_seed(4)
    source = torch.randint(0, 256, (8 << 20,), dtype=torch.uint8, generator=generator)
    target = torch.zeros(8 << 20, dtype=torch.uint8)
    _native.add_dest(owner._helper, 7, target.data_ptr(), 0, target.numel())
    _native.add_source(owner._helper, os.getpid(), 3, b"tok", source.data_ptr(), 0, source.numel())
    try:
        yield owner, source, target
    finally:
        owner.close()


def post_here(owner, source, target, slot_offset=0):
    """A one-piece job of this process (128 KiB at ``slot_offset``), or None if the board is full."""
    segment = (os.getpid(), 3, b"tok", 7, b"", target.data_ptr(), source.data_ptr())
    return _native.post(owner.address, [segment], [0], [slot_offset], [slot_offset], [RANGE])


def board_peer(owner, role: str, *args: str) -> JsonLinePeer:
    return JsonLinePeer(BOARD_PEER, role, str(os.getpid()), str(owner.fd), owner.token, *args)


# -- the board's size is sealed -------------------------------------------------------------------


def test_a_writer_that_maps_the_board_cannot_shrink_or_grow_it_and_the_board_goes_on_working(board):
    owner, source, target = board
    peer = board_peer(owner, "resize")
    peer.stop()
    assert peer.hello == {"shrink": "EPERM", "grow": "EPERM", "size": _native.BOARD_BYTES}
    job = post_here(owner, source, target)
    assert owner.help() == 1 and _native.finish(job, 5.0, -1) == (1, 1)
    assert torch.equal(target[:RANGE], source[:RANGE])


def board_memfd(seals: int) -> tuple[int, str]:
    """A board laid out on a memfd of this process with only ``seals``: its fd and token."""
    token = secrets.token_hex(8)
    fd = os.memfd_create(REGION_NAME_PREFIX + token, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, _native.BOARD_BYTES)
        if seals:
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
        with mmap.mmap(fd, _native.BOARD_BYTES) as memory:
            _native.init_board(
                ctypes.addressof(ctypes.c_char.from_buffer(memory))
            )  # a board in every other way
    except BaseException:
        os.close(fd)
        raise
    return fd, token


@pytest.mark.parametrize(
    "seals",
    [0, fcntl.F_SEAL_GROW, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW],
    ids=["unsealed", "grow-only", "not-sealed-for-good"],
)
def test_a_board_whose_size_can_still_change_is_refused_when_mapped(seals):
    fd, token = board_memfd(seals)
    try:
        with pytest.raises(RegionUnavailable, match="not sealed against any change of size"):
            copy_assist.PeerBoard(os.getpid(), fd, token)
    finally:
        os.close(fd)


def test_an_engine_offering_an_unsealed_board_gets_writes_copied_by_the_writer_alone(caplog):
    prefill = CrossMemoryEngine(
        "hostile-p", share_pages=True, copy_assist=False, inline_copies=True
    )
    decode = CrossMemoryEngine("hostile-d", share_pages=True, copy_assist=True)
    fd, token = board_memfd(0)
    try:
        forged = msgspec.structs.replace(decode.get_engine_desc(), assist_fd=fd, assist_token=token)
        with caplog.at_level(logging.WARNING):
            prefill.register_remote_engine(forged)
        assert "board cannot be mapped here" in caplog.text and "not sealed" in caplog.text
        source, target = (
            torch.full((4 << 20,), 5, dtype=torch.uint8),
            torch.zeros(4 << 20, dtype=torch.uint8),
        )
        session = prefill.create_session(
            prefill.register_torch_tensor(source), decode.register_torch_tensor(target)
        )
        status = session.batch_write([4096], [4096], [2 << 20], 1)
        assert status.wait_for(10_000) and status.code() == StatusCode.SUCCESS, status.message()
        assert torch.equal(target[4096 : 4096 + (2 << 20)], source[4096 : 4096 + (2 << 20)])
        assert prefill.assist_counts["jobs"] == 0
    finally:
        prefill.close()
        decode.close()
        os.close(fd)


# -- a writer that dies between post and finish ---------------------------------------------------


def killed_poster(owner, jobs: int = _native.BOARD_SLOTS) -> int:
    """A process that posted ``jobs`` jobs and was SIGKILLed before finishing any; its pid."""
    peer = board_peer(owner, "post", str(jobs), str(os.getpid()))
    try:
        assert peer.hello == {"posted": jobs}
    finally:
        peer.stop()  # SIGKILL by pid, reaped
    return peer.pid


def test_the_slots_of_a_writer_killed_between_post_and_finish_are_freed_once_and_said_once(
    board, caplog
):
    owner, source, target = board
    peer = board_peer(owner, "post", "16", str(os.getpid()))
    try:
        assert peer.hello == {"posted": 16}
        assert owner.help() == 16  # its first jobs are helped, never finished
        more = board_peer(owner, "post", "16", str(os.getpid()))
        more.stop()  # ... and a second writer's are never even helped
        assert more.hello == {"posted": 16}
    finally:
        peer.stop()
    assert post_here(owner, source, target) is None  # every slot is held by a dead writer
    with caplog.at_level(logging.WARNING):
        owner.sweep()
        owner.sweep()
    said = [r.getMessage() for r in caplog.records if "died with" in r.getMessage()]
    assert sorted(said) == sorted(
        f"copy assist: writer process {pid} died with 16 job(s) on the board; their "
        "slots are free again"
        for pid in (peer.pid, more.pid)
    )
    assert owner.stats()["slots_freed"] == 32
    target.zero_()
    jobs = [post_here(owner, source, target, k * RANGE) for k in range(_native.BOARD_SLOTS)]
    assert all(job is not None for job in jobs), "a dead writer's slot stayed taken"
    assert owner.help() == 32 and [_native.finish(job, 5.0, -1) for job in jobs] == [(1, 1)] * 32
    assert torch.equal(target[: 32 * RANGE], source[: 32 * RANGE])


def poster_words(owner):
    """Every slot's poster pid, as ctypes words over the board."""
    return [
        ctypes.c_uint32.from_address(
            owner.address
            + _native.SLOTS_OFFSET
            + k * _native.SLOT_BYTES
            + _native.SLOT_POSTER_OFFSET
        )
        for k in range(_native.BOARD_SLOTS)
    ]


def test_a_dead_writers_slots_are_kept_while_its_pid_belongs_to_a_live_process(board):
    """The dead writer's pid, taken by another process before the sweep: that process may be the
    one holding the slots, so they stay taken until no live process has the pid."""
    owner, source, target = board
    dead = killed_poster(owner)
    living = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        words = poster_words(owner)
        assert {word.value for word in words} == {dead}
        for word in words:
            word.value = living.pid  # as if the pid had been handed out again
        owner.sweep()
        assert owner.stats()["slots_freed"] == 0 and post_here(owner, source, target) is None
    finally:
        os.kill(living.pid, signal.SIGKILL)
        living.wait(10)
    owner.sweep()
    assert owner.stats()["slots_freed"] == 32 and post_here(owner, source, target) is not None


def test_a_slot_taken_by_a_live_writer_after_the_dead_one_was_seen_is_not_freed_under_it(board):
    """The sweep's look and its freeing race with writers: a slot freed and taken again in between
    holds another ticket, and stays the new writer's, whose write lands whole."""
    owner, source, target = board
    dead = killed_poster(owner)
    seen = _native.stale_slots(owner._helper)
    assert len(seen) == 32 and {pid for _, _, pid in seen} == {dead}
    assert _native.free_dead(owner._helper, [seen[5]]) == [seen[5]]  # freed meanwhile ...
    live = post_here(owner, source, target)  # ... and taken by a live writer
    assert live is not None and copy_assist.job_slot(live) == seen[5][0]
    freed = _native.free_dead(owner._helper, seen)  # the sweep goes on with what it saw
    assert seen[5] not in freed and len(freed) == 31
    assert owner.help() == 1 and _native.finish(live, 5.0, -1) == (1, 1)
    assert torch.equal(target[:RANGE], source[:RANGE])


def test_a_stale_slot_list_that_is_not_one_is_refused_by_name(board):
    owner, _, _ = board
    with pytest.raises(ValueError, match="stale"):
        _native.free_dead(owner._helper, [(_native.BOARD_SLOTS, 8, 1)])
    with pytest.raises(ValueError, match="stale"):
        _native.free_dead(owner._helper, [(0, 8, 1)])  # a free slot's ticket: nobody's to free
    with pytest.raises(TypeError):
        _native.free_dead(owner._helper, 7)


# -- made-up registrations by the thousand --------------------------------------------------------


class CountingUnpack:
    """The board's descriptor reader, counting: each call is one registration the board tries to map."""

    def __init__(self) -> None:
        self.calls = 0
        self.by_pid: dict[int, int] = {}

    def __call__(self, packed):
        self.calls += 1
        desc = CrossMemoryMemoryDesc.unpack(packed)
        self.by_pid[desc.pid] = self.by_pid.get(desc.pid, 0) + 1
        return desc


def memfd_mappings(token: str) -> int:
    with open("/proc/self/maps") as maps:
        return sum(token in line for line in maps)


def held_by_the_board() -> int:
    """Bytes still allocated by the board's Python side (copy_assist.py)."""
    snapshot = tracemalloc.take_snapshot().filter_traces(
        [tracemalloc.Filter(True, copy_assist.__file__)]
    )
    return sum(stat.size for stat in snapshot.statistics("filename"))


def flood(owner, mem, batch: int) -> None:
    """64 announcements: half made up around ``mem`` (this process's real registration, so each maps
    if tried), half naming processes that do not exist."""
    for k in range(64):
        n = batch * 64 + k
        pid = mem.pid if n % 2 else (1 << 30) + n
        fake = msgspec.structs.replace(mem, mem_id=1000 + n, pid=pid)
        _native.introduce(
            owner.address, (pid, 1000 + n, mem.shared_token.encode(), 7, fake.pack(), 0, 0)
        )


def test_a_flood_of_made_up_registrations_costs_each_help_call_little_and_memory_stays_bounded(
    monkeypatch, caplog
):
    """12,800 announcements, one help call after every 64, as a serving loop would make them, with
    the clock standing still (no allowance refills). Each call tries a bounded number, one writer
    no more than its allowance; the real memfd is mapped here once; what the board keeps and logs
    is bounded; and helping goes on afterwards."""
    clock = [0.0]
    monkeypatch.setattr(copy_assist, "_now", lambda: clock[0])
    monkeypatch.setattr(copy_assist.AssistBoard, "WRITER_BURST", 16)
    unpack = CountingUnpack()
    writer = CrossMemoryEngine("hostile-flood-w", share_pages=True, copy_assist=False)
    owner = copy_assist.AssistBoard(unpack)
    tracemalloc.start()
    try:
        source, target = (
            torch.full((4 << 20,), 9, dtype=torch.uint8),
            torch.zeros(4 << 20, dtype=torch.uint8),
        )
        mem = writer.register_torch_tensor(source)
        owner.add_dest(7, target.data_ptr(), 0, target.numel())
        mappings_before = memfd_mappings(mem.shared_token)
        with caplog.at_level(logging.WARNING, logger=copy_assist.__name__):
            for batch in range(200):
                flood(owner, mem, batch)
                before = unpack.calls
                owner.help()
                assert unpack.calls - before <= owner.MAPS_PER_HELP
                if batch == 99:
                    held_after_half = held_by_the_board()
            held_after_all = held_by_the_board()
        assert unpack.by_pid[mem.pid] == 16  # its allowance, then no more
        stats = owner.stats()
        assert stats["registrations_mapped"] == 16 and stats["registrations_deferred"] > 0
        assert memfd_mappings(mem.shared_token) == mappings_before + 1
        assert len(owner._allowance) <= owner.WRITERS_REMEMBERED
        assert held_after_all - held_after_half < 16 << 10  # the second half added nothing to keep
        refusals = [r for r in caplog.records if "cannot be mapped here" in r.getMessage()]
        assert 0 < len(refusals) <= owner.REFUSALS_LOGGED
        # Helping goes on: an hour later, once the announcements left were dealt with, a job naming
        # the real registration asks for it, and the next one is helped.
        clock[0] += 3600
        for _ in range(_native.MAX_UNKNOWN):
            owner.help()
        clock[0] += 3600
        low = mem.shared_start - mem.address
        seg = (
            mem.pid,
            mem.mem_id,
            mem.shared_token.encode(),
            7,
            mem.pack(),
            target.data_ptr(),
            mem.address,
        )
        first = _native.post(owner.address, [seg], [0], [low], [low], [RANGE])
        owner.help()
        _native.finish(first, 5.0, -1)
        target.zero_()
        job = _native.post(owner.address, [seg], [0], [low], [low], [RANGE])
        assert owner.help() == 1 and _native.finish(job, 5.0, -1) == (1, 1)
        assert torch.equal(target[low : low + RANGE], source[low : low + RANGE])
    finally:
        tracemalloc.stop()
        owner.close()
        writer.close()


def test_one_writer_is_allowed_a_burst_of_attempts_then_a_few_a_second_and_others_keep_theirs(
    monkeypatch,
):
    clock = [0.0]
    monkeypatch.setattr(copy_assist, "_now", lambda: clock[0])
    allowance = copy_assist._Allowance(burst=4, per_second=2.0, remembered=3)
    assert [allowance.take(100) for _ in range(5)] == [True] * 4 + [False]
    assert allowance.take(200)  # another writer has its own
    clock[0] += 1.0
    assert [allowance.take(100) for _ in range(3)] == [True, True, False]
    for pid in (300, 400, 500):
        allowance.take(pid)
    assert len(allowance) == 3  # bounded, the oldest forgotten

"""Copy assist: a large write into a peer's shared pages is copied by the writer and, where the peer's loop asks
to help, by the peer too.

What a user relies on: every byte lands where the write said, whichever side copied it; a helper that refuses,
stalls or whose process dies never makes a write hang or report bytes it did not move; a board that is not a
board, a full one, or one nobody serves only means the writer copies alone; a bad announcement never stops the
loop that helps. Every wait is bounded.
"""

import ctypes
import logging
import os
import signal
import subprocess
import sys
import threading
import time

import msgspec
import pytest
import torch

from moriio_fsm.engines import StatusCode
from moriio_fsm.engines.same_host import (
    CrossMemoryEngine,
    CrossMemoryMemoryDesc,
    assisted,
    copy_assist,
)

from ..json_peer import JsonLinePeer

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(
        not copy_assist.available(), reason="the native copy-assist module was not built"
    ),
]

_native = copy_assist._copy_assist
PAGE = 4096
RANGE = 128 << 10
PIECE = 256 << 10
PEER_SCRIPT = os.path.join(os.path.dirname(__file__), "cross_memory_peer.py")


def random_bytes(nbytes: int, seed: int) -> torch.Tensor:
    return torch.randint(
        0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)
    )


class HelpingLoop:
    """A thread that asks an engine to help without pause, as vLLM's engine loop asks for finished transfers."""

    def __init__(self, engine: CrossMemoryEngine) -> None:
        self.copied = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(engine,), name="test-helping-loop")
        self._thread.start()

    def _run(self, engine) -> None:
        while not self._stop.is_set():
            self.copied += engine.help_writers(0.002, 0.0005)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)
        assert not self._thread.is_alive()


@pytest.fixture
def pair():
    """P (no board of its own) writing into D, whose board is served by a helping loop; both in this process."""
    prefill = CrossMemoryEngine("assist-p", share_pages=True, copy_assist=False, inline_copies=True)
    decode = CrossMemoryEngine("assist-d", share_pages=True, copy_assist=True)
    loop = None
    try:
        source = random_bytes(24 << 20, seed=1)
        target = torch.zeros(24 << 20, dtype=torch.uint8)
        local = prefill.register_torch_tensor(source)
        remote = decode.register_torch_tensor(target)
        prefill.register_remote_engine(decode.get_engine_desc())
        session = prefill.create_session(local, remote)
        assert session is not None and session.mapped_remote_address is not None
        loop = HelpingLoop(decode)
        yield prefill, decode, session, source, target
    finally:
        if loop is not None:
            loop.stop()
        prefill.close()
        decode.close()


def scattered(count: int, seed: int):
    """``count`` 128 KiB ranges in a shuffled order, inside both tensors' shared pages."""
    order = torch.randperm(count, generator=torch.Generator().manual_seed(seed)).tolist()
    return [PAGE + k * RANGE for k in range(count)], [PAGE + k * RANGE for k in order]


def landed(source, target, local, remote, size=RANGE) -> bool:
    return all(
        torch.equal(target[r : r + size], source[lo : lo + size]) for lo, r in zip(local, remote)
    )


def test_layer_by_layer_writes_land_whole_and_the_peer_copies_part_of_them(pair):
    prefill, decode, sessions_one, source, target = pair
    for attempt in range(60):
        target.zero_()
        # A transfer's layers, posted together: each goes on the board as it is posted.
        local, remote = scattered(144, seed=attempt)
        with prefill.posting_together():
            statuses = [
                sessions_one.batch_write(local[k::8], remote[k::8], [RANGE] * 18, 1)
                for k in range(8)
            ]
        for status in statuses:
            assert status.wait_for(10_000) and status.code() == StatusCode.SUCCESS, status.message()
        assert landed(source, target, local, remote)
        if prefill.assist_counts["pieces_by_peer"] > 0:
            break
    assert prefill.assist_counts["jobs"] >= 8
    assert prefill.assist_counts["pieces_by_peer"] > 0, "the peer never copied a piece"
    helped = decode._board.stats()
    assert helped["ranges"] == prefill.assist_counts["pieces_by_peer"] and helped["refused"] == 0


def test_one_long_run_is_cut_into_pieces_the_peer_can_share(pair):
    prefill, _, session, source, target = pair
    for attempt in range(60):
        target.zero_()
        status = session.batch_write([PAGE], [PAGE + 4096 * attempt], [16 << 20], 1)
        assert status.wait_for(10_000) and status.code() == StatusCode.SUCCESS, status.message()
        assert landed(source, target, [PAGE], [PAGE + 4096 * attempt], 16 << 20)
        if prefill.assist_counts["pieces_by_peer"]:
            break
    assert prefill.assist_counts["pieces"] == (attempt + 1) * (16 << 20) // PIECE
    assert 0 < prefill.assist_counts["pieces_by_peer"]


def test_a_write_smaller_than_the_threshold_is_copied_by_the_writer_alone(pair):
    prefill, _, session, source, target = pair
    local, remote = scattered(4, seed=5)  # 512 KiB
    status = session.batch_write(local, remote, [RANGE] * 4, 1)
    assert status.wait_for(10_000) and status.code() == StatusCode.SUCCESS
    assert landed(source, target, local, remote)
    assert prefill.assist_counts["jobs"] == 0


def test_a_session_killed_while_the_writer_copies_what_is_left_gets_no_more_bytes(monkeypatch):
    """Nobody helps; the writer copies the jobs left in one native call that checks each job's
    session between pieces, so a kill that comes as it starts keeps every byte from landing."""
    prefill = CrossMemoryEngine(
        "assist-kp", share_pages=True, copy_assist=False, inline_copies=True
    )
    decode = CrossMemoryEngine("assist-kd", share_pages=True, copy_assist=True)
    try:
        source, target = random_bytes(8 << 20, seed=3), torch.zeros(8 << 20, dtype=torch.uint8)
        local, remote = prefill.register_torch_tensor(source), decode.register_torch_tensor(target)
        prefill.register_remote_engine(decode.get_engine_desc())
        sessions = [prefill.create_session(local, remote) for _ in range(2)]
        calls = []
        copy_left = copy_assist.copy_left

        def killed_as_it_starts(jobs, stops=None):
            for session in sessions:  # the transfer is torn down while the copy begins
                session.kill()
            calls.append(copy_left(jobs, stops))
            return calls[-1]

        monkeypatch.setattr(
            assisted, "copy_left", killed_as_it_starts
        )  # where the writer's side calls it
        size, spots = 2 << 20, [PAGE, PAGE + (3 << 20)]
        with prefill.posting_together():
            statuses = [
                session.batch_write([spot], [spot], [size], k + 1)
                for k, (session, spot) in enumerate(zip(sessions, spots))
            ]
        for status in statuses:
            assert status.wait_for(10_000) and status.code() != StatusCode.SUCCESS  # both torn down
        assert calls == [0] and not target.any()  # not one piece copied after the kill
    finally:
        prefill.close()
        decode.close()


def test_copy_left_stops_a_job_whose_stop_word_is_set_and_copies_the_others(board):
    owner, source, target = board
    stopped, going = ctypes.c_uint32(1), ctypes.c_uint32(0)
    first, second = (
        post(owner, source, target, 4),
        post(owner, source, target, 4, dst_offset=4 * RANGE, src_offset=4 * RANGE),
    )
    assert (
        copy_assist.copy_left([first, second], [ctypes.addressof(stopped), ctypes.addressof(going)])
        == 4
    )
    assert not target[: 4 * RANGE].any() and torch.equal(
        target[4 * RANGE : 8 * RANGE], source[4 * RANGE : 8 * RANGE]
    )
    assert _native.finish(first, 5.0, -1, False) == (0, 4) and _native.finish(second, 5.0, -1) == (
        0,
        4,
    )
    assert not target[: 4 * RANGE].any()  # given up: its pieces never copied
    with pytest.raises(ValueError, match="1 jobs but 2 stops"):
        copy_assist.copy_left([post(owner, source, target, 1)], [0, 0])


def assert_copied_alone(prefill, session, source, target) -> None:
    """A 2 MiB write lands whole, and went through no board."""
    status = session.batch_write([PAGE], [PAGE], [2 << 20], 1)
    assert status.wait_for(10_000) and status.code() == StatusCode.SUCCESS
    assert torch.equal(target[PAGE : PAGE + (2 << 20)], source[PAGE : PAGE + (2 << 20)])
    assert prefill.assist_counts["jobs"] == 0


def test_copy_assist_without_shared_pages_is_refused_by_name():
    with pytest.raises(ValueError, match="copy_assist needs share_pages"):
        CrossMemoryEngine("assist-bad", share_pages=False, copy_assist=True)


def test_a_descriptor_whose_board_is_not_a_board_leaves_the_writer_copying_alone(caplog):
    prefill = CrossMemoryEngine(
        "assist-p2", share_pages=True, copy_assist=False, inline_copies=True
    )
    decode = CrossMemoryEngine("assist-d2", share_pages=True, copy_assist=True)
    try:
        desc = decode.get_engine_desc()
        # The registration table's memfd, offered as a board: its name says it is not one.
        forged = msgspec.structs.replace(desc, assist_fd=desc.registry_fd)
        with caplog.at_level(logging.WARNING):
            prefill.register_remote_engine(forged)
        assert "board cannot be mapped here" in caplog.text
        source, target = random_bytes(4 << 20, seed=3), torch.zeros(4 << 20, dtype=torch.uint8)
        session = prefill.create_session(
            prefill.register_torch_tensor(source), decode.register_torch_tensor(target)
        )
        assert_copied_alone(prefill, session, source, target)
    finally:
        prefill.close()
        decode.close()


# -- the board's protocol, driven directly ----------------------------------------------------


@pytest.fixture
def board():
    """A board, a destination window (mem 7) over ``target`` and a source window (pid, mem 3) over ``source``."""
    owner = copy_assist.AssistBoard(CrossMemoryMemoryDesc.unpack)
    source, target = random_bytes(8 << 20, seed=2), torch.zeros(8 << 20, dtype=torch.uint8)
    _native.add_dest(owner._helper, 7, target.data_ptr(), 0, target.numel())
    _native.add_source(owner._helper, os.getpid(), 3, b"tok", source.data_ptr(), 0, source.numel())
    try:
        yield owner, source, target
    finally:
        owner.close()


def segment(source, target, dst_mem_id=7, src_mem_id=3, desc=b""):
    return (os.getpid(), src_mem_id, b"tok", dst_mem_id, desc, target.data_ptr(), source.data_ptr())


def post(owner, source, target, count, dst_mem_id=7, dst_offset=0, src_offset=0):
    offsets = [k * RANGE for k in range(count)]
    return _native.post(
        owner.address,
        [segment(source, target, dst_mem_id)],
        [0] * count,
        [src_offset + o for o in offsets],
        [dst_offset + o for o in offsets],
        [RANGE] * count,
    )


def test_a_job_helped_before_the_writer_finishes_is_copied_whole_by_the_helper(board):
    owner, source, target = board
    job = post(owner, source, target, 48)
    assert owner.help() == 48  # a range of 128 KiB is one piece
    assert _native.finish(job, 5.0, -1) == (48, 48)
    assert torch.equal(target[: 48 * RANGE], source[: 48 * RANGE])


def test_a_range_outside_the_helpers_windows_is_refused_and_the_writer_copies_it_all(board):
    owner, source, target = board
    # The writer's own addresses are fine; in the helper's table mem 7 ends at 8 MiB, and the job's
    # destination offsets start past it, so the helper refuses its first piece.
    wider = torch.zeros(16 << 20, dtype=torch.uint8)
    job = _native.post(
        owner.address,
        [segment(source, wider)],
        [0] * 8,
        [k * RANGE for k in range(8)],
        [(8 << 20) + k * RANGE for k in range(8)],
        [RANGE] * 8,
    )
    assert owner.help() == 0
    assert _native.finish(job, 5.0, -1) == (0, 8)
    assert owner.stats()["refused"] == 1
    assert torch.equal(wider[8 << 20 : (8 << 20) + 8 * RANGE], source[: 8 * RANGE])
    assert not target.any(), "the helper wrote outside the window it was given"


def test_a_job_naming_memory_not_mapped_here_is_left_to_the_writer_and_a_bad_descriptor_is_refused(
    board, caplog
):
    owner, source, target = board
    job = post(owner, source, target, 8, dst_mem_id=99)  # no such destination
    strange = _native.post(
        owner.address,
        [segment(source, target, src_mem_id=4, desc=b"not a descriptor")],
        [0] * 8,
        [0] * 8,
        [0] * 8,
        [RANGE] * 8,
    )
    with caplog.at_level(logging.WARNING):
        assert owner.help() == 0
    assert "memory 4 of process" in caplog.text and "cannot be mapped here" in caplog.text
    assert _native.finish(job, 5.0, -1) == (0, 8) and _native.finish(strange, 5.0, -1) == (0, 8)
    assert torch.equal(target[: 8 * RANGE], source[: 8 * RANGE])
    assert owner.help() == 0  # the loop goes on


def test_an_introduction_maps_a_writers_memory_before_its_first_job():
    writer = CrossMemoryEngine("assist-w", share_pages=True, copy_assist=False)
    owner = copy_assist.AssistBoard(CrossMemoryMemoryDesc.unpack)
    try:
        source, target = random_bytes(4 << 20, seed=6), torch.zeros(4 << 20, dtype=torch.uint8)
        mem = writer.register_torch_tensor(source)
        low = mem.shared_start - mem.address
        owner.add_dest(9, target.data_ptr(), 0, target.numel())
        seg = (
            mem.pid,
            mem.mem_id,
            mem.shared_token.encode(),
            9,
            mem.pack(),
            target.data_ptr(),
            mem.address,
        )
        _native.introduce(owner.address, seg)
        assert owner.help() == 0 and owner.stats()["registrations_mapped"] == 1, (
            "the introduction was not mapped"
        )
        job = _native.post(owner.address, [seg], [0], [low], [low], [2 << 20])
        assert owner.help() == 8
        assert _native.finish(job, 5.0, -1) == (8, 8)
        assert torch.equal(target[low : low + (2 << 20)], source[low : low + (2 << 20)])
    finally:
        owner.close()
        writer.close()


def slot_ticket(owner, state):
    """The ticket of the first slot in ``state`` (2: posted), as a ctypes word over the board."""
    for index in range(_native.BOARD_SLOTS):
        word = ctypes.c_uint32.from_address(
            owner.address + _native.SLOTS_OFFSET + index * _native.SLOT_BYTES
        )
        if word.value & 7 == state:
            return word
    raise AssertionError("no slot in that state")


def test_a_helper_that_takes_a_job_and_never_leaves_it_fails_the_write_after_the_timeout(board):
    owner, source, target = board
    job = post(owner, source, target, 8)
    word = slot_ticket(owner, 2)
    word.value = (word.value & ~7) | 3  # a helper took it, then stalled
    with pytest.raises(TimeoutError, match="did not finish its part within 0.200 s"):
        _native.finish(job, 0.2, -1)
    assert word.value & 7 == 7  # abandoned: the helper frees it if it ever leaves


def test_a_write_whose_destination_process_exits_mid_job_says_so_instead_of_waiting(board):
    owner, source, target = board
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    pidfd = os.pidfd_open(child.pid)
    try:
        job = post(owner, source, target, 8)
        word = slot_ticket(owner, 2)
        word.value = (word.value & ~7) | 3
        os.kill(child.pid, signal.SIGKILL)
        child.wait(10)
        with pytest.raises(ProcessLookupError, match="exited during the copy"):
            _native.finish(job, 30.0, pidfd)
    finally:
        os.close(pidfd)
        if child.poll() is None:
            child.kill()
            child.wait(10)


def test_a_full_board_turns_writes_away_and_a_job_dropped_unfinished_frees_its_slot(board):
    owner, source, target = board
    jobs = [post(owner, source, target, 1) for _ in range(_native.BOARD_SLOTS)]
    assert all(job is not None for job in jobs)
    assert post(owner, source, target, 1) is None
    del jobs[0]  # collected without finish: its slot goes back
    assert post(owner, source, target, 1) is not None


@pytest.mark.parametrize(
    "args, error, words",
    [
        (("segments", [0], [0], [0], [1]), TypeError, "segments"),
        (([("x",)], [0], [0], [0], [1]), TypeError, r"segments\[0\]"),
        (
            ([(1, 2, b"t" * 33, 3, b"", 1, 1)], [0], [0], [0], [1]),
            ValueError,
            "token of at most 32 bytes",
        ),
        (
            ([(1, 2, b"t", 3, b"d" * 5000, 1, 1)], [0], [0], [0], [1]),
            ValueError,
            "descriptor of at most",
        ),
        (([(1, 2, b"t", 3, b"", 1, 1)], [1], [0], [0], [1]), ValueError, "names no segment"),
        (([(1, 2, b"t", 3, b"", 1, 1)], [0, 0], [0], [0], [1]), ValueError, "differ in length"),
        (([(1, 2, b"t", 3, b"", 1, 1)], [0], [-1], [0], [1]), ValueError, r"src_offsets\[0\]"),
        (
            ([(1, 2, b"t", 3, b"", 1, 1)], [0], [0], [0], ["1"]),
            TypeError,
            r"sizes\[0\]: expected an int",
        ),
        (
            ([(1, 2, b"t", 3, b"", 1, 1)], [0], [0], [2**64 - 2], [4]),
            ValueError,
            "past the end of the address",
        ),
        (
            ([(1, 2, b"t", 3, b"", 1, 1)], [0, 0], [0, 0], [0, 0], [2**63, 2**63]),
            ValueError,
            "more than 2",
        ),
        (([(1, 2, b"t", 3, b"", 1, 1)], [], [], [], []), ValueError, "1 to 2048 ranges"),
        (([(1, 2, b"t", 3, b"", 1, 1)] * 17, [0], [0], [0], [1]), ValueError, "1 to 16 segments"),
    ],
)
def test_ill_typed_or_impossible_jobs_are_refused_before_anything_is_posted(
    board, args, error, words
):
    owner, source, target = board
    with pytest.raises(error, match=words):
        _native.post(owner.address, *args)
    free = [post(owner, source, target, 1) for _ in range(_native.BOARD_SLOTS)]
    assert all(job is not None for job in free), "a refused job kept a slot"


@pytest.mark.parametrize("waits", [(-1.0,), (2.0,), (0.0, float("nan")), ("soon",)])
def test_help_refuses_waits_that_are_not_a_short_number_of_seconds(board, waits):
    with pytest.raises((ValueError, TypeError)):
        _native.help(board[0]._helper, *waits)


def test_memory_that_is_not_a_board_is_refused_by_name():
    junk = torch.zeros(_native.BOARD_BYTES, dtype=torch.uint8)
    with pytest.raises(ValueError, match="not a copy-assist board"):
        _native.check_board(junk.data_ptr())
    with pytest.raises(ValueError, match="not a copy-assist board"):
        _native.post(junk.data_ptr(), [], [], [], [], [])
    with pytest.raises(ValueError, match="64-byte-aligned"):
        _native.check_board(junk.data_ptr() + 1)


@pytest.mark.parametrize("helped", [True, False], ids=["helper copies", "writer copies"])
@pytest.mark.parametrize("count", [64, 65, 2048])
def test_a_job_of_many_scattered_ranges_lands_byte_exact(board, count, helped):
    """Jobs of as many ranges as a post keeps on its stack, one more, and a full slot, scattered
    over 8 MiB, copied by the helper or by the writer from its own copy of the ranges."""
    owner, source, target = board
    size = (8 << 20) // 2048 - 64  # gaps between ranges, so nothing merges
    dst = [k * (8 << 20) // count for k in range(count)]
    src = [(8 << 20) - size - d for d in dst]  # read back to front
    job = _native.post(
        owner.address, [segment(source, target)], [0] * count, src, dst, [size] * count
    )
    assert job is not None
    by_helper = owner.help() if helped else 0
    by_peer, pieces = _native.finish(job, 5.0, -1)
    # Small ranges: one piece each, all copied by whoever came first.
    assert pieces == count and by_peer == by_helper == (count if helped else 0)
    for d, s in zip(dst, src):
        assert torch.equal(target[d : d + size], source[s : s + size])
    untouched = torch.ones(8 << 20, dtype=torch.bool)
    for d in dst:
        untouched[d : d + size] = False
    assert not target[untouched].any()  # nothing written between the ranges


def test_the_writer_copies_what_is_left_of_several_jobs_at_once_and_finish_then_only_waits(board):
    owner, source, target = board
    jobs = [
        post(owner, source, target, 4, dst_offset=k * 4 * RANGE, src_offset=k * 4 * RANGE)
        for k in range(3)
    ]
    assert copy_assist.copy_left(jobs) == 12
    assert copy_assist.copy_left(jobs) == 0  # nothing is claimed twice
    assert owner.help() == 0  # nothing left for the helper
    assert [_native.finish(job, 5.0, -1) for job in jobs] == [(0, 4)] * 3
    assert torch.equal(target[: 12 * RANGE], source[: 12 * RANGE])
    assert copy_assist.copy_left([]) == 0


def test_copy_left_refuses_a_finished_job_or_a_non_job_before_copying_anything(board):
    owner, source, target = board
    done, fresh = (
        post(owner, source, target, 1),
        post(owner, source, target, 2, dst_offset=RANGE, src_offset=RANGE),
    )
    _native.finish(done, 5.0, -1)
    target.zero_()
    with pytest.raises(RuntimeError, match="job 1 was finished already"):
        copy_assist.copy_left([fresh, done])
    with pytest.raises(ValueError):
        copy_assist.copy_left([fresh, object()])
    with pytest.raises(TypeError, match="jobs"):
        copy_assist.copy_left(7)
    assert not target.any()  # refused before any copy
    assert _native.finish(fresh, 5.0, -1) == (0, 2)  # the job is still whole and finishes normally
    assert torch.equal(target[RANGE : 3 * RANGE], source[RANGE : 3 * RANGE])


def test_finishing_a_job_twice_is_an_error_not_a_second_copy(board):
    owner, source, target = board
    job = post(owner, source, target, 2)
    _native.finish(job, 5.0, -1)
    with pytest.raises(RuntimeError, match="finished already"):
        _native.finish(job, 5.0, -1)


def test_a_dropped_destination_gets_no_more_help_and_a_closed_board_none_at_all(board):
    owner, source, target = board
    owner.drop_dest(7)
    job = post(owner, source, target, 8)
    assert owner.help() == 0
    assert _native.finish(job, 5.0, -1) == (0, 8)  # copied by the writer alone
    assert torch.equal(target[: 8 * RANGE], source[: 8 * RANGE])
    # A writer's own mapping of the board outlives its owner's close; nobody helps there any more.
    mapped = copy_assist.PeerBoard(os.getpid(), owner.fd, owner.token)
    owner.close()
    target.zero_()
    offsets = [k * RANGE for k in range(8)]
    job = mapped.post([segment(source, target)], [0] * 8, offsets, offsets, [RANGE] * 8)
    assert owner.help() == 0 and mapped.finish(job, -1, 1.0) == (0, 8)
    assert torch.equal(target[: 8 * RANGE], source[: 8 * RANGE])


def test_a_help_call_waiting_for_work_helps_the_job_posted_meanwhile(board):
    owner, source, target = board
    done = []
    waiter = threading.Thread(target=lambda: done.append(owner.help(wait_s=1.0, linger_s=0.0)))
    waiter.start()
    # It is asleep on the board: the post wakes it, and it copies the pieces the writer has not claimed.
    job = post(owner, source, target, 32)
    waiter.join(10)
    by_peer, pieces = _native.finish(job, 5.0, -1)
    assert not waiter.is_alive() and done == [by_peer]
    assert pieces == 32 and torch.equal(target[: 32 * RANGE], source[: 32 * RANGE])


def test_writers_racing_on_one_board_all_land(board):
    owner, source, target = board
    loop = threading.Thread(target=lambda: [owner.help(0.002, 0.0005) for _ in range(400)])
    loop.start()
    problems = []

    def writer(index: int) -> None:
        # Each writer and round copies other bytes, so a piece copied from a stale or reused slot shows.
        for round_ in range(20):
            base, src = index * (2 << 20), ((index * 20 + round_) % 3) * (2 << 20)
            job = post(owner, source, target, 16, dst_offset=base, src_offset=src)
            if job is not None:
                _native.finish(job, 5.0, -1)
            if not torch.equal(target[base : base + 16 * RANGE], source[src : src + 16 * RANGE]):
                problems.append((index, round_))

    writers = [threading.Thread(target=writer, args=(index,)) for index in range(4)]
    for thread in writers:
        thread.start()
    for thread in writers + [loop]:
        thread.join(60)
    assert not problems and not any(thread.is_alive() for thread in writers + [loop])


# -- across processes ----------------------------------------------------------------------


def test_a_decode_process_helps_with_writes_into_it_and_every_byte_lands():
    region = 24 << 20
    peer = JsonLinePeer(PEER_SCRIPT, "owner", "assist-decode", str(region), "share", "help")
    try:
        with CrossMemoryEngine("assist-prefill", share_pages=True, copy_assist=False) as engine:
            engine.register_remote_engine(
                engine.unpack_engine_desc(bytes.fromhex(peer.hello["engine"]))
            )
            source = random_bytes(region, seed=9)
            session = engine.create_session(
                engine.register_torch_tensor(source),
                engine.unpack_memory_desc(bytes.fromhex(peer.hello["memory"])),
            )
            assert (
                session.mapped_remote_address is not None
                and engine._peers["assist-decode"].board is not None
            )
            for attempt in range(40):
                local, remote = scattered(144, seed=attempt)
                with engine.posting_together():
                    statuses = [
                        session.batch_write(local[k::8], remote[k::8], [RANGE] * 18, 1)
                        for k in range(8)
                    ]
                for status in statuses:
                    assert status.wait_for(10_000) and status.code() == StatusCode.SUCCESS, (
                        status.message()
                    )
                for lo, r in zip(local[::24], remote[::24]):
                    assert peer.dump(r, RANGE) == source[lo : lo + RANGE].numpy().tobytes()
                if engine.assist_counts["pieces_by_peer"]:
                    break
            assert engine.assist_counts["pieces_by_peer"] > 0, (
                "the decode process never copied a piece"
            )
            stats = peer.ask(op="assist")
            assert (
                stats["ranges"] == engine.assist_counts["pieces_by_peer"] and stats["refused"] == 0
            )
            # The decode process dies: later writes fail, and none hangs.
            peer.stop()
            local, remote = scattered(144, seed=99)
            status = session.batch_write(local, remote, [RANGE] * 144, 1)
            assert status.wait_for(10_000)
            assert status.code() != StatusCode.SUCCESS
    finally:
        peer.stop()


# -- what the review of the first version found -------------------------------------------------


def test_closing_the_writer_with_a_write_still_on_the_board_lets_its_memory_go_at_once():
    from moriio_fsm.engines.same_host import registrations

    prefill = CrossMemoryEngine(
        "assist-p3", share_pages=True, copy_assist=False, inline_copies=True, deregister_wait_s=5.0
    )
    decode = CrossMemoryEngine("assist-d3", share_pages=True, copy_assist=True)
    try:
        source, target = random_bytes(8 << 20, seed=7), torch.zeros(8 << 20, dtype=torch.uint8)
        session = prefill.create_session(
            prefill.register_torch_tensor(source),
            (
                prefill.register_remote_engine(decode.get_engine_desc()),
                decode.register_torch_tensor(target),
            )[1],
        )
        lingering = len(registrations._lingering)
        with prefill.posting_together():
            status = session.batch_write([PAGE], [PAGE], [4 << 20], 1)
            assert prefill._assisted.posted, "the write was not put on the board"
            prefill.close()  # the write's registrations are held by the job: close gives it up
        assert status.wait_for(1000) and status.code() == StatusCode.ERR_BAD_STATE
        assert len(registrations._lingering) == lingering, (
            "close waited for, then kept, memory the job held"
        )
    finally:
        prefill.close()
        decode.close()


def test_a_descriptor_too_long_for_the_board_gets_no_help_and_its_writes_still_land():
    prefill = CrossMemoryEngine("p" * 500, share_pages=True, copy_assist=False, inline_copies=True)
    decode = CrossMemoryEngine("assist-d4", share_pages=True, copy_assist=True)
    try:
        prefill.register_remote_engine(decode.get_engine_desc())
        source, target = random_bytes(4 << 20, seed=8), torch.zeros(4 << 20, dtype=torch.uint8)
        session = prefill.create_session(
            prefill.register_torch_tensor(source), decode.register_torch_tensor(target)
        )
        assert session is not None and session.assist_segment() is None
        assert_copied_alone(prefill, session, source, target)
    finally:
        prefill.close()
        decode.close()


def test_sizes_near_two_to_the_64_are_cut_or_refused_without_crashing(board):
    owner, source, target = board
    seg = [(1, 2, b"t", 3, b"", 1 << 40, 1 << 40)]
    # 2047 ranges adding up to 2**64 - 1: one piece each (the job is dropped, never copied).
    sizes = [1 << 53] * 2046 + [(2**64 - 1) - 2046 * (1 << 53)]
    job = _native.post(owner.address, seg, [0] * 2047, [0] * 2047, [0] * 2047, sizes)
    assert job is not None
    del job
    # One range of nearly 2**64 bytes that still fits the address space is cut (and dropped); one more
    # past it is refused.
    assert _native.post(owner.address, seg, [0], [0], [0], [2**64 - 2**41]) is not None
    with pytest.raises(ValueError, match="past the end of the address space"):
        _native.post(owner.address, seg, [0], [0], [0], [2**64 - 2**39])


def test_a_half_written_introduction_does_not_keep_help_calls_awake(board):
    owner, source, target = board
    intro = _native.SLOTS_OFFSET + _native.BOARD_SLOTS * _native.SLOT_BYTES
    ctypes.c_uint32.from_address(owner.address + intro).value = 1  # odd: a writer died mid-write
    ctypes.c_uint32.from_address(owner.address + 16).value += 1  # intro_next: "something new"
    assert owner.help() == 0
    helper = owner._helper
    # Nothing is left to look at: a call with no wait returns at once, without taking the lock.
    assert _native.help(helper) == (0, False)


def test_a_write_the_board_cannot_take_is_turned_away_by_name_for_the_writer_to_copy(board, caplog):
    owner, source, target = board
    mapped = copy_assist.PeerBoard(os.getpid(), owner.fd, owner.token)
    with caplog.at_level(logging.WARNING):
        assert mapped.post([segment(source, target)], [0], [0], [0], [2**64 - 1]) is None
    assert (
        "could not be posted" in caplog.text and "past the end of the address space" in caplog.text
    )
    assert all(post(owner, source, target, 1) is not None for _ in range(_native.BOARD_SLOTS))


def holders(engine, session) -> tuple[dict, dict]:
    """The registrations this process holds, in its own table and in the peer's."""
    return dict(engine._own.registry._holders), dict(session.peer.registry._holders)


def slow_let_go(monkeypatch) -> list[float]:
    """Make letting go of a session's registrations take 2 ms (bookkeeping that must not show
    in end times); the times each let-go began."""
    from moriio_fsm.engines.same_host import CrossMemorySession

    let_go_at: list[float] = []
    let_go = CrossMemorySession.let_go

    def slow(self):
        let_go_at.append(time.monotonic())
        time.sleep(0.002)
        let_go(self)

    monkeypatch.setattr(CrossMemorySession, "let_go", slow)
    return let_go_at


def test_layers_posted_together_end_when_their_last_piece_landed_not_after_the_bookkeeping(
    pair, monkeypatch
):
    """Each status says when its copy ended: every end is seen before any registration is let
    go, so a completion made from it does not carry the other layers' letting go."""
    prefill, decode, session, source, target = pair
    let_go_at = slow_let_go(monkeypatch)
    local, remote = scattered(144, seed=11)
    started = time.monotonic()
    with prefill.posting_together():
        statuses = [
            session.batch_write(local[k::8], remote[k::8], [RANGE] * 18, 1) for k in range(8)
        ]
        posted = time.monotonic()
    for status in statuses:
        assert status.wait_for(10_000) and status.code() == StatusCode.SUCCESS, status.message()
    assert landed(source, target, local, remote)
    ends = [status.final_at() for status in statuses]
    assert len(let_go_at) == 8 and all(posted <= end <= let_go_at[0] for end in ends), (
        started,
        ends,
        let_go_at,
    )
    assert ends == sorted(ends)  # seen in the order they were posted
    assert holders(prefill, session) == ({}, {})


def test_a_layer_whose_helper_never_leaves_fails_alone_and_every_registration_is_let_go(
    pair, monkeypatch, caplog
):
    """The wait for one layer's helper times out, another's raises a bug: those two fail by name,
    the other layers land, and nothing stays held."""
    prefill, decode, session, source, target = pair
    finish = copy_assist.PeerBoard.finish
    calls = []

    def finish_some_badly(self, job, pidfd, timeout_s=None, copy=True):
        calls.append(job)
        result = finish(self, job, pidfd, timeout_s, copy)  # the job ends whatever is said after
        if len(calls) == 2:
            raise TimeoutError(
                "copy assist: the destination's helper did not finish its part within 1.000 s"
            )
        if len(calls) == 5:
            raise RuntimeError("a bug in the board")
        return result

    monkeypatch.setattr(copy_assist.PeerBoard, "finish", finish_some_badly)
    local, remote = scattered(144, seed=12)
    with prefill.posting_together():
        statuses = [
            session.batch_write(local[k::8], remote[k::8], [RANGE] * 18, 1) for k in range(8)
        ]
    for status in statuses:
        assert status.wait_for(10_000)
    codes = [status.code() for status in statuses]
    assert (
        codes
        == [StatusCode.SUCCESS]
        + [StatusCode.ERR_RDMA_OP]
        + [StatusCode.SUCCESS] * 2
        + [StatusCode.ERR_BAD_STATE]
        + [StatusCode.SUCCESS] * 3
    ), [s.message() for s in statuses]
    assert (
        "did not finish its part" in statuses[1].message() and "assist-d" in statuses[1].message()
    )
    assert "a bug in the board" in statuses[4].message() and "a bug in the board" in caplog.text
    assert holders(prefill, session) == ({}, {})


def test_writes_too_small_for_help_end_when_copied_not_after_their_registrations_go(
    pair, monkeypatch
):
    """Writes under the help threshold go as one copy when the block ends: each status says
    the copy's end, which comes before any of their registrations is let go."""
    prefill, decode, session, source, target = pair
    let_go_at = slow_let_go(monkeypatch)
    local, remote = scattered(32, seed=3)  # 8 writes of 4 x 128 KiB, each under 1 MiB
    with prefill.posting_together():
        statuses = [
            session.batch_write(local[k::8], remote[k::8], [RANGE] * 4, 1) for k in range(8)
        ]
    for status in statuses:
        assert status.wait_for(10_000) and status.code() == StatusCode.SUCCESS, status.message()
    assert landed(source, target, local, remote)
    assert len(let_go_at) == 8 and all(status.final_at() <= let_go_at[0] for status in statuses)

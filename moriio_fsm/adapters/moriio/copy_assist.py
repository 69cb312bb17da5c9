"""Copy assist for same-host writes: the destination's process copies part of each large write.

A writer (P) confined to one core copies a transfer alone while the destination (D) waits for
those very bytes on a core of its own: vLLM's engine loop asks for finished transfers without
pause while a request waits for its KV. ``AssistBoard`` (the destination's side) offers a job
board in shared memory, and its ``help``, called from that loop, copies ranges of the jobs
posted there; ``PeerBoard`` (the writer's side) posts a write and copies alongside, both
taking ranges off one counter. Rules: helping copies only between windows installed here
(this engine's registrations and writers' pages mapped here, each range checked); a writer
never waits for the helper without a bound; without the native module there is no board
and writers copy alone.
"""

from __future__ import annotations

import logging
import os
import select
import threading
import time
from dataclasses import dataclass

from .shared_memory import PeerMapping, RegionUnavailable, SharedRegion
from .shared_pages import PeerPages

try:
    from . import _copy_assist
except ImportError:          # built without a C compiler: no assist, every writer copies alone
    _copy_assist = None

__all__ = ["AssistBoard", "PeerBoard", "available", "copy_left", "job_slot", "DESC_MAX"]

#: The longest packed memory descriptor a board holds (longer: that memory gets no help).
DESC_MAX = _copy_assist.DESC_MAX if _copy_assist is not None else 0

_log = logging.getLogger(__name__)


def available() -> bool:
    """Whether this install has the native copy-assist module."""
    return _copy_assist is not None


def copy_left(jobs, stops=None) -> int:
    """Copy here the pieces of ``jobs`` (posted, not finished) that nobody has claimed yet, in
    that order, without waiting for any peer; the pieces copied. Their ``finish`` then only
    waits for the peer's pieces in hand. ``stops``: per job the address of a 32-bit word (0:
    none); once it is non-zero, no more of that job is copied here."""
    return _copy_assist.copy_left(jobs, stops)


def job_slot(job) -> int:
    """The board slot ``job`` was posted in: the peer helps a board's jobs in ascending slot
    order, so a writer copying what is left goes the other way and meets it only once."""
    return _copy_assist.job_slot(job)


@dataclass(slots=True)
class _Source:
    pages: PeerPages      # the writer's registration mapped here; copies read it while this lives
    pidfd: int            # readable once the writer's process exited


class AssistBoard:
    """This engine's job board; peers map it by ``fd`` and ``token``.

    ``add_dest``/``drop_dest`` install and remove this engine's registrations as places
    helping may write. A writer's registration is mapped by the ``help`` call that first
    sees it named, in the writer's introduction (made with its session) or in a job (that
    job is left to the writer), and let go once the writer's process exits. ``close`` waits
    for the help calls in progress; none touches the board after it.
    """

    #: How often ``help`` looks for writers that exited, to let go of their pages.
    SWEEP_INTERVAL_S = 1.0

    def __init__(self, unpack_memory_desc) -> None:
        if _copy_assist is None:
            raise RuntimeError("copy assist needs the native module _copy_assist, which this install lacks")
        self._unpack = unpack_memory_desc   # bytes -> a memory descriptor (pid, mem_id, shared_* fields)
        self._region, self._memory = SharedRegion.allocate(_copy_assist.BOARD_BYTES)
        self.address = self._memory.data_ptr()
        _copy_assist.init_board(self.address)
        self._helper = _copy_assist.serve(self.address)
        self._lock = threading.Lock()        # the mappings below, for help called on several threads
        self._sources: dict[tuple[int, int], _Source] = {}
        self._refused: set[tuple[int, int]] = set()
        self._next_sweep = time.monotonic() + self.SWEEP_INTERVAL_S
        self._closed = False

    @property
    def fd(self) -> int:
        return self._region.fd

    @property
    def token(self) -> str:
        return self._region.token

    def add_dest(self, mem_id: int, address: int, low: int, high: int) -> None:
        """Let helping write offsets [low, high) of this engine's registration ``mem_id`` at ``address``."""
        _copy_assist.add_dest(self._helper, mem_id, address, low, high)

    def drop_dest(self, mem_id: int) -> None:
        """No copy into ``mem_id`` once this returns (it waits for the job being helped)."""
        if not self._closed:
            _copy_assist.drop_dest(self._helper, mem_id)

    def help(self, wait_s: float = 0.0, linger_s: float = 0.0) -> int:
        """Copy ranges of every job posted now, without the GIL; the ranges this call copied.

        ``wait_s``: first wait up to that long for a job; ``linger_s``: after helping, wait that
        long for the next (a transfer posts a job per layer). Bounded (``_copy_assist.help``)."""
        if self._closed:
            return 0
        try:
            copied, named_unknown = _copy_assist.help(self._helper, wait_s, linger_s)
        except RuntimeError:      # closed meanwhile
            return 0
        if named_unknown or time.monotonic() >= self._next_sweep:
            with self._lock:
                try:
                    for pid, mem_id, packed in _copy_assist.unknown(self._helper):
                        self._map_source(pid, mem_id, packed)
                    if time.monotonic() >= self._next_sweep:
                        self._next_sweep = time.monotonic() + self.SWEEP_INTERVAL_S
                        self._forget_exited()
                except RuntimeError:      # closed meanwhile: close lets go of every mapping
                    pass
        return copied

    def interrupt(self) -> None:
        """A help call waiting for work returns now: the loop it holds has news (a transfer ended)."""
        if not self._closed:
            _copy_assist.interrupt(self._helper)

    def stats(self) -> dict[str, int]:
        """Jobs helped, ranges and bytes copied here, and jobs cut short by a range outside every window."""
        if self._closed:
            return {"jobs": 0, "ranges": 0, "bytes": 0, "refused": 0}
        return _copy_assist.stats(self._helper)

    def _map_source(self, pid: int, mem_id: int, packed: bytes) -> None:
        key = (pid, mem_id)
        if key in self._refused or key in self._sources:
            return
        try:
            desc = self._unpack(packed)
            if desc.pid != pid or desc.mem_id != mem_id or not desc.shares_pages:
                raise ValueError(f"the descriptor names memory {desc.mem_id} of process {desc.pid}, "
                                 f"{'with' if desc.shares_pages else 'without'} shared pages")
            pages = PeerPages(desc.pid, desc.shared_fd, desc.shared_token, desc.shared_size, desc.shared_start)
            pidfd = os.pidfd_open(pid)
        except Exception as exc:     # noqa: BLE001 - a writer's bad descriptor must not end the caller's loop
            self._refused.add(key)
            _log.warning("copy assist: memory %s of process %s cannot be mapped here (%s); its writes are "
                         "copied by the writer alone", mem_id, pid, exc)
            return
        low = desc.shared_start - desc.address
        try:
            _copy_assist.add_source(self._helper, pid, mem_id, desc.shared_token.encode(), pages.address - low,
                                    low, low + desc.shared_size)
        except (OverflowError, ValueError, RuntimeError) as exc:
            os.close(pidfd)
            self._refused.add(key)
            _log.warning("copy assist: memory %s of process %s gets no help: %s", mem_id, pid, exc)
            return
        self._sources[key] = _Source(pages, pidfd)

    def _forget_exited(self) -> None:
        """Let go of exited writers' pages, so that a dead writer's KV cache does not stay resident."""
        for key, source in list(self._sources.items()):
            poll = select.poll()
            poll.register(source.pidfd, select.POLLIN)
            if poll.poll(0):
                _copy_assist.drop_source(self._helper, *key)   # waits for a job reading them
                del self._sources[key]
                os.close(source.pidfd)
                self._refused.discard(key)

    def close(self) -> None:
        """Help no more (after the job being helped), let go of every writer's pages; idempotent."""
        if self._closed:
            return
        self._closed = True
        _copy_assist.close(self._helper)   # waits for help calls in progress; none touches the board after
        with self._lock:
            for source in self._sources.values():
                os.close(source.pidfd)
            self._sources.clear()
        self._region.close()
        self._memory = None    # unmapped once collected: after close no help call touches the board


class PeerBoard:
    """A peer engine's job board mapped here: where this engine's writes into that peer get help."""

    #: Longest wait for the peer once this side has copied every piece left: a helper holds
    #: one piece (about 256 KiB) at a time, so only a stopped or starved peer is that slow.
    FINISH_TIMEOUT_S = 1.0

    def __init__(self, pid: int, fd: int, token: str) -> None:
        if _copy_assist is None:
            raise RuntimeError("copy assist needs the native module _copy_assist, which this install lacks")
        self._mapping = PeerMapping(pid, fd, token, _copy_assist.BOARD_BYTES)
        self.address = self._mapping.tensor.data_ptr()
        _copy_assist.check_board(self.address)
        self.pid = pid

    MAX_RANGES = _copy_assist.MAX_RANGES if _copy_assist is not None else 0
    MAX_SEGMENTS = _copy_assist.MAX_SEGMENTS if _copy_assist is not None else 0

    def introduce(self, segment) -> bool:
        """Announce a registration of this engine (a segment of ``post``) ahead of its first job,
        so that the peer maps it before that job: the first job of a session is otherwise left
        to this side. False when every announcement slot was being written."""
        return _copy_assist.introduce(self.address, segment)

    def post(self, segments, segment_of_range, src_offsets, dst_offsets, sizes):
        """Put a write on the board (see ``_copy_assist.post``); None if no slot was free, or
        if the write cannot go on a board (logged; the caller then copies it alone)."""
        try:
            # The job holds this object, and with it the mapping, until it is freed.
            return _copy_assist.post(self.address, segments, segment_of_range, src_offsets, dst_offsets, sizes,
                                     self)
        except ValueError as exc:   # cannot happen for an engine's checked batches
            # The text, not the exception: a kept log record must not keep this mapping alive.
            _log.warning("copy assist: a write could not be posted (%s); it is copied by the writer alone", str(exc))
            return None

    def finish(self, job, pidfd: int, timeout_s: float | None = None, copy: bool = True) -> tuple[int, int]:
        """Copy what is left of ``job`` here and wait for the peer's part; (pieces the peer
        copied, pieces in all: ranges are cut into pieces of about 256 KiB).

        ``TimeoutError`` or ``ProcessLookupError`` when the peer's part may not have landed.
        ``copy`` False: give the job up (nothing more is copied; the peer's piece in hand is waited for)."""
        return _copy_assist.finish(job, self.FINISH_TIMEOUT_S if timeout_s is None else timeout_s, pidfd, copy)

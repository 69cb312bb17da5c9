"""Copy assist for same-host writes: the destination's process copies part of each large write.

A writer (P) confined to one core copies a transfer alone while the destination (D) waits for
those very bytes on a core of its own: vLLM's engine loop asks for finished transfers without
pause while a request waits for its KV. ``AssistBoard`` (the destination's side) offers a job
board in shared memory, and its ``help``, called from that loop, copies ranges of the jobs
posted there; ``PeerBoard`` (the writer's side) posts a write and copies alongside, both
taking ranges off one counter. Rules: helping copies only between windows installed here
(this engine's registrations and writers' pages mapped here, each range checked); a writer
never waits for the helper without a bound; the board's size is sealed, so no side can make
the other fault on it; what writers announce costs a help call and this process bounded work
and memory; a writer's death frees its board slots at the next sweep; without the native
module there is no board and writers copy alone.
"""

from __future__ import annotations

import logging
import os
import select
import threading
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..shared_memory import PeerMapping, RegionUnavailable, SharedRegion
from .shared_pages import PeerPages

if TYPE_CHECKING:
    import torch

try:
    import moriio_fsm.engines.same_host._copy_assist as _copy_assist
except ImportError:  # built without a C compiler: no assist, every writer copies alone
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


#: The clock of sweeps and of writers' allowances (a test may stop it).
_now = time.monotonic


def _exited(pidfd: int) -> bool:
    """Whether the process of ``pidfd`` exited (a pidfd turns readable then)."""
    poll = select.poll()
    poll.register(pidfd, select.POLLIN)
    return bool(poll.poll(0))


@dataclass(slots=True)
class _Writer:
    """A writer process whose registrations are mapped here."""

    pidfd: int
    # (mem_id, token) -> (the pages mapped here, where the writer maps them); copies read them while this lives
    sources: dict[tuple[int, bytes], tuple[PeerPages, int]] = field(default_factory=dict)

    def pages_like(self, desc) -> PeerPages | None:
        """Pages of this writer mapped here already that ``desc`` names too (one mapping per memfd)."""
        for pages, start in self.sources.values():
            if (
                pages.token == desc.shared_token
                and pages.size == desc.shared_size
                and start == desc.shared_start
            ):
                return pages
        return None


class _Allowance:
    """Mapping attempts each writer process may still make: a bucket of ``burst`` that refills at
    ``per_second``, kept for the last ``remembered`` processes that asked (one pushed out starts
    afresh: ``AssistBoard.MAPS_PER_HELP`` still bounds each help call)."""

    def __init__(self, burst: int, per_second: float, remembered: int) -> None:
        self._burst, self._rate, self._remembered = burst, per_second, remembered
        self._buckets: OrderedDict[int, tuple[float, float]] = (
            OrderedDict()
        )  # pid -> (attempts left, when)

    def take(self, pid: int) -> bool:
        now = _now()
        left, then = self._buckets.pop(pid, (self._burst, now))
        left = min(self._burst, left + max(0.0, now - then) * self._rate)
        allowed = left >= 1
        self._buckets[pid] = (left - 1 if allowed else left, now)
        if len(self._buckets) > self._remembered:
            self._buckets.popitem(last=False)
        return allowed

    def __len__(self) -> int:
        return len(self._buckets)


class AssistBoard:
    """This engine's job board; peers map it by ``fd`` and ``token``.

    ``add_dest``/``drop_dest`` install and remove this engine's registrations as places
    helping may write. A writer's registration is mapped by the ``help`` call that first sees
    it named, in the writer's introduction (made with its session) or in a job (that job is
    left to the writer), and let go once the writer's process exits. Whatever writers
    announce, a help call tries to map at most ``MAPS_PER_HELP`` registrations, each writer
    process gets ``WRITER_BURST`` attempts then ``WRITER_RATE`` a second, and what is refused
    is remembered in bounded memory. The slots of a writer that died with jobs on the board
    are freed by the sweep. ``close`` waits for the help calls in progress; none touches the
    board after it.
    """

    #: How often ``help`` looks for writers that exited, to let go of their pages and slots.
    SWEEP_INTERVAL_S = 1.0
    #: Registrations one help call may try to map: each attempt reads the writer's memory map
    #: (milliseconds in a large process), and the caller is a serving loop with its own work.
    MAPS_PER_HELP = 2
    #: Mapping attempts per writer process: a burst (a session introduces one registration per
    #: layer), then so many a second; for this many processes at once.
    WRITER_BURST = 256
    WRITER_RATE = 16.0
    WRITERS_REMEMBERED = 64
    #: Registrations of one writer process mapped at once (the helper's table holds 1024 in all).
    SOURCES_PER_WRITER = 256
    #: Refusals logged one by one per sweep; more are summed up in one line.
    REFUSALS_LOGGED = 4

    def __init__(self, unpack_memory_desc) -> None:
        if _copy_assist is None:
            raise RuntimeError(
                "copy assist needs the native module _copy_assist, which this install lacks"
            )
        self._unpack = (
            unpack_memory_desc  # bytes -> a memory descriptor (pid, mem_id, shared_* fields)
        )
        # Sealed: a writer that could shrink the board would kill this process in its serving loop.
        self._region, memory = SharedRegion.allocate(_copy_assist.BOARD_BYTES, sealed=True)
        self._memory: torch.Tensor | None = memory
        self.address = memory.data_ptr()
        _copy_assist.init_board(self.address)
        self._helper = _copy_assist.serve(self.address)
        self._lock = threading.Lock()  # the mappings below, for help called on several threads
        self._writers: dict[int, _Writer] = {}
        self._allowance = _Allowance(self.WRITER_BURST, self.WRITER_RATE, self.WRITERS_REMEMBERED)
        self._counts = {"registrations_refused": 0, "registrations_deferred": 0, "slots_freed": 0}
        self._refusals_said = self._refusals_unsaid = 0
        self._next_sweep = _now() + self.SWEEP_INTERVAL_S
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
        long for the next (a transfer posts a job per layer). Bounded (``_copy_assist.help``),
        and so is the mapping of writers' registrations that follows (``MAPS_PER_HELP``)."""
        if self._closed:
            return 0
        try:
            copied, named_unknown = _copy_assist.help(self._helper, wait_s, linger_s)
        except RuntimeError:  # closed meanwhile
            return 0
        if named_unknown:
            with self._lock:
                try:
                    self._map_named()
                except RuntimeError:  # closed meanwhile: close lets go of every mapping
                    pass
        if _now() >= self._next_sweep:
            self.sweep()
        return copied

    def sweep(self) -> None:
        """Let go of the pages of writers that exited, and free the board slots of writers that
        died with a job on it; ``help`` does this every ``SWEEP_INTERVAL_S``."""
        with self._lock:
            self._next_sweep = _now() + self.SWEEP_INTERVAL_S
            try:
                self._forget_exited()
                self._free_dead_posters()
            except RuntimeError:  # closed meanwhile
                return
            if self._refusals_unsaid:
                _log.warning(
                    "copy assist: %d more writers' registrations cannot be mapped here; their writes are "
                    "copied by the writers alone",
                    self._refusals_unsaid,
                )
            self._refusals_said = self._refusals_unsaid = 0

    def interrupt(self) -> None:
        """A help call waiting for work returns now: the loop it holds has news (a transfer ended)."""
        if not self._closed:
            _copy_assist.interrupt(self._helper)

    def stats(self) -> dict[str, int]:
        """Jobs helped, ranges and bytes copied here, jobs cut short by a range outside every
        window (``refused``); writers' registrations mapped here now, refused, and put off for
        their writer's allowance; board slots freed after their writer died."""
        with self._lock:
            counts = dict(
                self._counts,
                registrations_mapped=sum(len(w.sources) for w in self._writers.values()),
            )
        if self._closed:
            return {"jobs": 0, "ranges": 0, "bytes": 0, "refused": 0, **counts}
        return {**_copy_assist.stats(self._helper), **counts}

    def _map_named(self) -> None:
        """Map a few of the registrations jobs or introductions named (the rest wait for later calls)."""
        for pid, mem_id, token, packed in _copy_assist.unknown(self._helper, self.MAPS_PER_HELP):
            if self._allowance.take(pid):
                self._map_source(pid, mem_id, token, packed)
            else:
                # Not refused: asked for again by that writer's next job or introduction.
                self._counts["registrations_deferred"] += 1

    def _map_source(self, pid: int, mem_id: int, token: bytes, packed: bytes) -> None:
        """Map a writer's registration and let helping read it, or refuse it for good (logged)."""
        known = self._writers.get(pid)
        if known is not None and len(known.sources) >= self.SOURCES_PER_WRITER:
            self._refuse(
                pid,
                mem_id,
                token,
                f"process {pid} has {self.SOURCES_PER_WRITER} registrations mapped here",
            )
            return
        writer = known or _Writer(-1)
        try:
            desc = self._described(pid, mem_id, token, packed)
            if known is None:
                writer.pidfd = os.pidfd_open(
                    pid
                )  # before mapping: a pid reused meanwhile shows as exited below
            pages = writer.pages_like(desc) or PeerPages(
                desc.pid, desc.shared_fd, desc.shared_token, desc.shared_size, desc.shared_start
            )
            if _exited(writer.pidfd):
                raise RegionUnavailable(f"process {pid} exited")
            low = desc.shared_start - desc.address
            _copy_assist.add_source(
                self._helper, pid, mem_id, token, pages.address - low, low, low + desc.shared_size
            )
        except Exception as exc:  # noqa: BLE001 - a writer's bad descriptor must not end the caller's loop
            if known is None and writer.pidfd >= 0:
                os.close(writer.pidfd)
            if isinstance(exc, RuntimeError):
                raise  # closed meanwhile: nothing to refuse
            self._refuse(pid, mem_id, token, str(exc))
            return
        writer.sources[(mem_id, token)] = (pages, desc.shared_start)
        self._writers[pid] = writer

    def _described(self, pid: int, mem_id: int, token: bytes, packed: bytes):
        """The descriptor a job or introduction carries, if it is of the registration it names."""
        desc = self._unpack(packed)
        if (desc.pid, desc.mem_id, desc.shared_token.encode()) != (
            pid,
            mem_id,
            token,
        ) or not desc.shares_pages:
            raise ValueError(
                f"the descriptor names memory {desc.mem_id} of process {desc.pid}, "
                f"{'with' if desc.shares_pages else 'without'} shared pages"
            )
        return desc

    def _refuse(self, pid: int, mem_id: int, token: bytes, why: str) -> None:
        """Never ask again for a registration that cannot be mapped (in bounded memory), and say so
        (a few times per sweep: announcements can be made up by the thousand)."""
        _copy_assist.refuse(self._helper, pid, mem_id, token)
        self._counts["registrations_refused"] += 1
        if self._refusals_said >= self.REFUSALS_LOGGED:
            self._refusals_unsaid += 1
            return
        self._refusals_said += 1
        _log.warning(
            "copy assist: memory %s of process %s cannot be mapped here (%s); its writes are copied by "
            "the writer alone",
            mem_id,
            pid,
            why,
        )

    def _forget_exited(self) -> None:
        """Let go of exited writers' pages, so that a dead writer's KV cache does not stay resident."""
        for pid, writer in list(self._writers.items()):
            if _exited(writer.pidfd):
                for mem_id in {mem_id for mem_id, _ in writer.sources}:
                    _copy_assist.drop_source(
                        self._helper, pid, mem_id
                    )  # waits for a job reading them
                del self._writers[pid]
                os.close(writer.pidfd)

    def _free_dead_posters(self) -> None:
        """Free the slots of writers that died between posting a job and finishing it, which
        would otherwise stay taken until this process ends; said once per writer."""
        stale = _copy_assist.stale_slots(self._helper)
        if not stale:
            return
        freed = Counter(pid for _, _, pid in _copy_assist.free_dead(self._helper, stale))
        for pid, slots in freed.items():
            _log.warning(
                "copy assist: writer process %s died with %d job(s) on the board; their slots are free "
                "again",
                pid,
                slots,
            )
        self._counts["slots_freed"] += sum(freed.values())

    def close(self) -> None:
        """Help no more (after the job being helped), let go of every writer's pages; idempotent."""
        if self._closed:
            return
        self._closed = True
        _copy_assist.close(
            self._helper
        )  # waits for help calls in progress; none touches the board after
        with self._lock:
            for writer in self._writers.values():
                os.close(writer.pidfd)
            self._writers.clear()
        self._region.close()
        self._memory = None  # unmapped once collected: after close no help call touches the board


class PeerBoard:
    """A peer engine's job board mapped here: where this engine's writes into that peer get help."""

    def __init__(self, pid: int, fd: int, token: str) -> None:
        if _copy_assist is None:
            raise RuntimeError(
                "copy assist needs the native module _copy_assist, which this install lacks"
            )
        # Sealed, or refused: a board its owner (or another writer) could shrink would kill this
        # process in ``post``.
        self._mapping = PeerMapping(pid, fd, token, _copy_assist.BOARD_BYTES, sealed=True)
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
            return _copy_assist.post(
                self.address, segments, segment_of_range, src_offsets, dst_offsets, sizes, self
            )
        except ValueError as exc:  # cannot happen for an engine's checked batches
            # The text, not the exception: a kept log record must not keep this mapping alive.
            _log.warning(
                "copy assist: a write could not be posted (%s); it is copied by the writer alone",
                str(exc),
            )
            return None

    def finish(self, job, pidfd: int, timeout_s: float, copy: bool = True) -> tuple[int, int]:
        """Copy what is left of ``job`` here and wait for the peer's part, at most ``timeout_s`` once
        this side is done; (pieces the peer copied, pieces in all: ranges are cut into pieces of about
        256 KiB). ``pidfd``: the peer's process, whose exit ends the wait (-1: none).

        ``TimeoutError`` or ``ProcessLookupError`` when the peer's part may not have landed.
        ``copy`` False: give the job up (nothing more is copied; the peer's piece in hand is waited for)."""
        return _copy_assist.finish(job, timeout_s, pidfd, copy)

"""CrossMemoryEngine: one-sided writes and reads between processes on one host, into tensors the other process allocated.

Rules: mori's status semantics (posting returns at once, one worker thread settles each batch, bad values give
already-failed statuses); bytes move only while both registrations are held in their owners' tables (``registry``),
by a memory copy into the peer's adopted pages where it shares them (``shared_pages``), else by process_vm_writev /
process_vm_readv (``iovec``); faults come from ``engine.faults`` as in LoopbackEngine.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import heapq
import itertools
import logging
import mmap
import os
import select
import socket
import threading
import time
import traceback
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Annotated, Any

import msgspec
import torch

from . import iovec, local_copy
from . import copy_assist as _assist
from .iovec import CrossMemoryError, move_ranges, native_calls_problem
from .resident import pin_pages, unpin_pages
from ..shared_memory import RegionUnavailable
from .shared_pages import MemoryClaim, PeerPages, claim_memory
from .registry import TOKEN_BYTES, PublishedRegistry, RegistryUnavailable, RegistryView
from ..interface import ArgumentProblem, CheckedBatch, TransferEngine, TransferSession, check_transfer_batch, require_bytes
from ..faults import NO_FAULT, InjectedFailure, LoopbackFaults, PostedTransfer
from ..status import LocalTransferStatus, StatusCode, failed_status

__all__ = [
    "CrossMemoryEngine",
    "CrossMemoryEngineDesc",
    "CrossMemoryError",
    "CrossMemoryMemoryDesc",
    "CrossMemorySession",
]

_log = logging.getLogger(__name__)

_Positive = Annotated[int, msgspec.Meta(gt=0)]
_NonNegative = Annotated[int, msgspec.Meta(ge=0)]
_Token = Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{0,32}$")]

# prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY): Yama's per-process opt-in for ptrace_scope 1.
_PR_SET_PTRACER = 0x59616D61
_PR_SET_PTRACER_ANY = ctypes.c_ulong(-1).value

# Memory a peer may still have been copying when its owner let go of it (a peer stopped
# mid-transfer outlasted the wait): kept allocated for the life of the process, so that
# such a copy lands in memory nobody uses. A leak, never a corruption.
_lingering: list[torch.Tensor] = []


class CrossMemoryEngineDesc(msgspec.Struct, frozen=True, tag="moriio-cma-engine"):
    """Who a cross-memory engine is: its process, host, pid namespace and registration table."""

    key: str
    pid: _Positive
    boot_id: str
    pid_namespace: int
    registry_fd: _NonNegative
    token: bytes
    token_address: _Positive
    hostname: str = ""
    host: str = ""
    port: int = 0
    # Its copy-assist board (``copy_assist``): a memfd at this fd of the engine's process,
    # named with this token; -1: it offers none, and writers into it copy alone.
    assist_fd: int = -1
    assist_token: _Token = ""

    def pack(self) -> bytes:
        return msgspec.msgpack.encode(self)

    @classmethod
    def unpack(cls, packed: Any) -> "CrossMemoryEngineDesc":
        """Raises ``TypeError`` for non-bytes and ``ValueError`` for bytes that are not such a descriptor."""
        return _decode("engine descriptor", cls, packed)


class CrossMemoryMemoryDesc(msgspec.Struct, frozen=True, tag="moriio-cma-memory"):
    """One registered tensor: its owner, its slot in the owner's table, where it lives and how big it is."""

    engine_key: str
    mem_id: _Positive
    slot: _NonNegative
    pid: _Positive
    address: _Positive
    size: _Positive
    dtype: str
    shape: tuple[int, ...]
    # The whole pages of it the owner shares (``AdoptedPages``): a memfd at this fd of the
    # owner, named with this token, mapped at shared_start for shared_size bytes; -1: none.
    shared_fd: int = -1
    shared_token: _Token = ""
    shared_start: _NonNegative = 0
    shared_size: _NonNegative = 0

    def __post_init__(self) -> None:
        if self.shared_fd < 0:
            if self.shared_fd != -1 or self.shared_token or self.shared_start or self.shared_size:
                raise ValueError("shared_fd is -1 when no pages are shared, with no token, start or size")
            return
        if not self.shared_token or self.shared_size == 0 or self.shared_start % mmap.PAGESIZE:
            raise ValueError("shared pages need a token, a size and a page-aligned start")
        if self.shared_start < self.address or self.shared_start + self.shared_size > self.address + self.size:
            raise ValueError(f"shared pages [{self.shared_start:#x}, +{self.shared_size}) lie outside the "
                             f"memory [{self.address:#x}, +{self.size})")

    @property
    def shares_pages(self) -> bool:
        return self.shared_fd >= 0

    def pack(self) -> bytes:
        return msgspec.msgpack.encode(self)

    @classmethod
    def unpack(cls, packed: Any) -> "CrossMemoryMemoryDesc":
        """Raises ``TypeError`` for non-bytes and ``ValueError`` for bytes that are not such a descriptor."""
        return _decode("memory descriptor", cls, packed)


def _decode(what: str, kind: type, packed: Any):
    data = require_bytes(what, packed)
    try:
        return msgspec.msgpack.decode(data, type=kind)
    except msgspec.DecodeError as exc:  # ValidationError included
        raise ValueError(f"{what} is not a packed {kind.__name__}: {exc}") from None


def _absolute_ranges(group: list[_Posted], here: bool) -> tuple[list[int], list[int], list[int], int]:
    """The ranges of several batches as absolute addresses (local, remote), sizes and their total.

    Remote addresses are the peer's own, or with ``here`` where its memory is mapped in this process.
    """
    local: list[int] = []
    remote: list[int] = []
    sizes: list[int] = []
    for posted in group:
        batch, session = posted.batch, posted.session
        local_base = session.local_mem.address
        remote_base = session.mapped_remote_address if here else session.remote_mem.address
        local.extend(local_base + offset for offset in batch.local_offsets)
        remote.extend(remote_base + offset for offset in batch.remote_offsets)
        sizes.extend(batch.sizes)
    return local, remote, sizes, sum(sizes)


def _host_identity() -> tuple[str, int]:
    """This boot of this host, and this process's pid namespace: a pid means something only within both."""
    with open("/proc/sys/kernel/random/boot_id") as handle:
        boot_id = handle.read().strip()
    return boot_id, os.stat("/proc/self/ns/pid").st_ino


def _allow_same_user_tracers() -> None:
    """Let same-user processes attach to this one under Yama ptrace_scope 1 (a no-op without Yama)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PTRACER, ctypes.c_ulong(_PR_SET_PTRACER_ANY), 0, 0, 0) != 0:
        if ctypes.get_errno() != errno.EINVAL:  # EINVAL: no Yama, so nothing to relax
            _log.warning("prctl(PR_SET_PTRACER_ANY) failed: %s", os.strerror(ctypes.get_errno()))


def _close_peer_handles(pidfd: int, registry: RegistryView) -> None:
    os.close(pidfd)
    registry.close()


def _copy_here(op: str, local_base: int, remote_base: int, local_offsets: list[int], remote_offsets: list[int],
               sizes: list[int], *, range_base: int = 0, bytes_base: int = 0) -> None:
    """Move ranges between two blocks of this process's memory (the peer's mapped here): "write"
    copies local -> remote, "read" remote -> local. It cannot fail part-way: the memory is
    mapped for as long as the session that asked lives, and sealed against shrinking."""
    if op == "write":
        local_copy.copy_ranges(remote_base, remote_offsets, local_base, local_offsets, sizes)
    else:
        local_copy.copy_ranges(local_base, local_offsets, remote_base, remote_offsets, sizes)


class _Peer:
    """An engine this one can reach: a pidfd on its process and an open of its registration table.

    The handles are closed at engine close, or once no session uses the peer any more.
    """

    def __init__(self, desc: CrossMemoryEngineDesc, pidfd: int, registry: RegistryView, *,
                 use_board: bool = True) -> None:
        self.desc = desc
        self.registry = registry
        self.withdrawn = False  # the remote engine was deregistered (or re-registered anew)
        self._exit = select.poll()
        self._exit.register(pidfd, select.POLLIN)  # a pidfd turns readable when its process exits
        # A poll object refuses two threads at once ("concurrent poll() invocation"), and
        # sessions of several threads ask whether the peer is gone.
        self._exit_lock = threading.Lock()
        self._handles = weakref.finalize(self, _close_peer_handles, pidfd, registry)
        self._pages_lock = threading.Lock()
        # mem_id -> (its descriptor, this process's mapping of its shared pages or None if
        # they could not be mapped). A session keeps its mapping alive on its own.
        self._pages: dict[int, tuple[CrossMemoryMemoryDesc, PeerPages | None]] = {}
        self._refusals_said: set[int] = set()
        self.pidfd = pidfd
        self._introduced: set[tuple] = set()   # this engine's registrations announced to its board
        # Where its process helps with writes into it (None: this engine copies them alone).
        self.board: _assist.PeerBoard | None = None
        if use_board and desc.assist_fd >= 0 and _assist.available():
            try:
                self.board = _assist.PeerBoard(desc.pid, desc.assist_fd, desc.assist_token)
            except (RegionUnavailable, OSError, ValueError) as exc:
                _log.warning("engine %r offers copy assist, but its board cannot be mapped here (%s); writes "
                             "into it are copied here alone", desc.key, exc)

    def introduce(self, segment: tuple) -> None:
        """Announce one of this engine's registrations on the peer's board, once per registration."""
        key = segment[:3]                 # pid, mem_id, token
        board = self.board
        with self._pages_lock:
            if board is None or key in self._introduced:
                return
            self._introduced.add(key)
        if not board.introduce(segment):  # every slot busy: its first job asks instead
            with self._pages_lock:
                self._introduced.discard(key)

    def pages_of(self, mem: CrossMemoryMemoryDesc) -> PeerPages | None:
        """This process's mapping of ``mem``'s shared pages, made on first use; None without one."""
        with self._pages_lock:
            known = self._pages.get(mem.mem_id)
        if known is not None and known[0] == mem:
            return known[1]
        mapping = None
        try:
            mapping = PeerPages(mem.pid, mem.shared_fd, mem.shared_token, mem.shared_size, mem.shared_start)
        except (RegionUnavailable, OSError) as exc:
            # Said once per memory: a failure is retried after each sweep, under traffic too.
            said = mem.mem_id in self._refusals_said
            self._refusals_said.add(mem.mem_id)
            (_log.debug if said else _log.warning)(
                "memory %s of engine %r: its shared pages cannot be mapped (%s); the kernel copies into it "
                "instead", mem.mem_id, self.desc.key, exc)
        if self.gone() is not None:   # the pid may have been someone else's when the fd was opened
            return None
        self.forget_stale_pages()
        with self._pages_lock:
            self._pages[mem.mem_id] = (mem, mapping)
        return mapping

    def forget_stale_pages(self) -> None:
        """Let go of mappings of memory the owner no longer registers (its pages are given back),
        and of failures to map, so that a later session tries again."""
        with self._pages_lock:
            known = list(self._pages.items())
        stale = [mem_id for mem_id, (desc, mapping) in known
                 if mapping is None or not self.registry.holds(desc.slot, desc.mem_id, desc.address, desc.size)]
        with self._pages_lock:
            for mem_id in stale:
                self._pages.pop(mem_id, None)

    def withdraw(self) -> None:
        """This peer is no longer reachable through this engine: its sessions fail from now on."""
        self.withdrawn = True
        with self._pages_lock:
            self._pages.clear()

    def gone(self) -> str | None:
        """Why transfers to this peer must fail, or None."""
        if self.withdrawn or not self._handles.alive:
            return f"remote engine {self.desc.key!r} was deregistered"
        with self._exit_lock:
            exited = self._exit.poll(0)
        if exited:
            # Its memory lives on while mapped here: let go of it (sessions still hold theirs).
            with self._pages_lock:
                self._pages.clear()
            return f"process {self.desc.pid} of engine {self.desc.key!r} is gone"
        return None

    def close(self) -> None:
        with self._pages_lock:
            self._pages.clear()
        self.board = None   # a job posted there keeps the mapping until it ends
        self._handles()


def _attach(desc: CrossMemoryEngineDesc, own: CrossMemoryEngineDesc) -> _Peer:
    """Check that ``desc`` names a live engine this process may attach to; raises ``CrossMemoryError`` if not."""
    if desc.boot_id != own.boot_id:
        raise CrossMemoryError(
            errno.EXDEV, f"engine {desc.key!r} runs on another host or boot (boot id {desc.boot_id}, "
                         f"here {own.boot_id}): cross-memory attach reaches processes on this host only")
    if desc.pid_namespace != own.pid_namespace:
        raise CrossMemoryError(
            errno.EXDEV, f"engine {desc.key!r} runs in another pid namespace (inode {desc.pid_namespace}, "
                         f"here {own.pid_namespace}), where pid {desc.pid} names another process: run both "
                         "in one pid namespace (containers: --pid=host or a shared pod)")
    try:
        pidfd = os.pidfd_open(desc.pid)
    except ProcessLookupError:
        raise CrossMemoryError(errno.ESRCH, f"process {desc.pid} of engine {desc.key!r} is gone") from None
    try:
        _probe(desc)
        registry = RegistryView.open(desc.pid, desc.registry_fd, desc.token)
    except RegistryUnavailable as exc:
        os.close(pidfd)
        raise CrossMemoryError(exc.errno, f"engine {desc.key!r}: {exc.strerror}") from None
    except BaseException:
        os.close(pidfd)
        raise
    # An engine's handle on itself needs no board: a copy within one process gains nothing from help.
    peer = _Peer(desc, pidfd, registry, use_board=desc is not own)
    reason = peer.gone()
    if reason is not None:  # it died while being checked: the pid may already be someone else's
        peer.close()
        raise CrossMemoryError(errno.ESRCH, reason)
    return peer


def _probe(desc: CrossMemoryEngineDesc) -> None:
    """Read the engine's token out of its memory: proves the permission and that the pid is that engine."""
    found = ctypes.create_string_buffer(TOKEN_BYTES)
    try:
        move_ranges(iovec.SYSCALLS["read"], desc.pid, "read", ctypes.addressof(found), desc.token_address,
                    [0], [0], [TOKEN_BYTES])
    except CrossMemoryError as exc:
        raise CrossMemoryError(exc.errno, f"cannot attach to engine {desc.key!r}: {exc}") from None
    if found.raw != desc.token:
        raise CrossMemoryError(
            errno.ESTALE, f"process {desc.pid} is not engine {desc.key!r}: its pid now belongs to another process")


@dataclass(frozen=True, slots=True)
class _Registration:
    desc: CrossMemoryMemoryDesc
    tensor: torch.Tensor  # held so the memory cannot be freed while peers may reach it
    claim: MemoryClaim
    pinned: bool = False

    def let_go(self, copies_ended: bool) -> bool:
        """Unlock the memory and release its claim, giving shared pages back to private memory
        once ``copies_ended``; False if pages stay shared (the memory must then never be freed)."""
        if self.pinned:
            unpin_pages(self.desc.address, self.desc.size)
        return self.claim.release(give_back=copies_ended)


@dataclass(slots=True, eq=False)
class _Posted:
    status: LocalTransferStatus
    session: "CrossMemorySession"
    op: str
    batch: CheckedBatch
    failure: InjectedFailure | None
    here: bool   # the copy is a memory copy in this process (the peer's pages are mapped here)
    # (the peer's board, the job) of a write put there when posted; its registrations are held until it ends.
    job: tuple | None = None
    # When its copy ended (time.monotonic), set by the copy: its status is settled with it later.
    ended_at: float | None = None


class CrossMemorySession(TransferSession):
    """A channel from one local registered tensor to one registered tensor of a peer engine on this host."""

    def __init__(self, engine: "CrossMemoryEngine", local: CrossMemoryMemoryDesc,
                 remote: CrossMemoryMemoryDesc, peer: _Peer, local_plain: bool = False) -> None:
        self._engine = engine
        self.local_mem = local
        self.remote_mem = remote
        self.remote_engine_key = remote.engine_key  # what fault rules match on
        self._peer = peer
        # Where the remote memory can be reached in this process, if it can: a peer's pages
        # mapped here (held by the session, so they stay mapped while it lives), and only
        # when the local memory is plain memory a copy cannot fault on.
        self._pages = None
        self.mapped_remote_address: int | None = None
        self._here_low = self._here_high = 0    # remote offsets the mapping covers
        self._segment: tuple | None = None
        self._stopped = ctypes.c_uint32(0)      # see stop_word
        if local_plain and remote.shares_pages and (pages := peer.pages_of(remote)) is not None:
            self._pages = pages
            self.mapped_remote_address = pages.address - remote.shared_start + remote.address
            self._here_low = remote.shared_start - remote.address
            self._here_high = self._here_low + remote.shared_size
        if peer.board is not None and self.assist_segment() is not None:
            # Mapped by the peer before this session's first write, which it can then help with.
            peer.introduce(self._segment)

    def assist_segment(self) -> tuple | None:
        """How a copy-assist job names this session's two registrations (``_copy_assist.post``);
        None where the peer cannot be helped to them (no shared pages here or there, or a
        descriptor longer than a board holds)."""
        if self._segment is None and self.mapped_remote_address is not None and self.local_mem.shares_pages:
            local = self.local_mem
            packed = local.pack()
            if len(packed) <= _assist.DESC_MAX:
                self._segment = (local.pid, local.mem_id, local.shared_token.encode(), self.remote_mem.mem_id,
                                 packed, self.mapped_remote_address, local.address)
        return self._segment

    def helpable(self, batch: CheckedBatch) -> bool:
        """Whether the peer can copy ``batch`` for this session: every local range lies in this
        memory's shared pages (all the peer maps of it); the remote ones were checked on posting."""
        local = self.local_mem
        if self.assist_segment() is None:
            return False
        low = local.shared_start - local.address
        high = low + local.shared_size
        offsets = batch.local_offsets
        return min(offsets) >= low and max(map(int.__add__, offsets, batch.sizes)) <= high

    def _copies_here(self, batch: CheckedBatch) -> bool:
        """Whether every remote range of ``batch`` lies where this process can reach it."""
        if self.mapped_remote_address is None:
            return False
        offsets = batch.remote_offsets
        return min(offsets) >= self._here_low and max(map(int.__add__, offsets, batch.sizes)) <= self._here_high

    def allocate_transfer_uid(self) -> int:
        return self._engine.allocate_transfer_uid()

    def batch_write(self, local_offsets, remote_offsets, sizes, transfer_uid):
        return self._post("write", local_offsets, remote_offsets, sizes, transfer_uid)

    def batch_read(self, local_offsets, remote_offsets, sizes, transfer_uid):
        return self._post("read", local_offsets, remote_offsets, sizes, transfer_uid)

    @property
    def stop_word(self) -> int:
        """The address of a word that turns non-zero once this session is killed: native copies
        of its jobs check it between pieces, without the GIL."""
        return ctypes.addressof(self._stopped)

    def note_killed(self) -> None:
        """Called by the fault rules when this session is killed: its copies in progress stop."""
        self._stopped.value = 1

    def kill(self) -> None:
        """Break this session (same as ``engine.faults.kill_session(self)``)."""
        self._engine.faults.kill_session(self)

    def alive(self) -> bool:
        local, remote = self.local_mem, self.remote_mem
        return (self._why_dead() is None
                and self._engine._own.registry.holds(local.slot, local.mem_id, local.address, local.size)
                and self._peer.registry.holds(remote.slot, remote.mem_id, remote.address, remote.size))

    def _why_dead(self) -> str | None:
        if self._engine.closed:
            return "engine is closed"
        return self._engine.faults.session_fault(self) or self._peer.gone()

    def _post(self, op, local_offsets, remote_offsets, sizes, transfer_uid):
        checked = check_transfer_batch(
            local_offsets, remote_offsets, sizes, transfer_uid,
            local_size=self.local_mem.size, remote_size=self.remote_mem.size,
        )
        if isinstance(checked, ArgumentProblem):
            return failed_status(checked.code, f"batch_{op}: {checked.message}")
        return self._engine._submit(self, op, checked)

    def _hold(self) -> tuple[int, str] | None:
        """Hold both registrations for a copy; the failure that forbids it, or None (then ``_let_go`` after)."""
        reason = self._why_dead()
        if reason is not None:
            return self._failure(reason)
        local, remote = self.local_mem, self.remote_mem
        own_table = self._engine._own.registry
        if not own_table.hold(local.slot, local.mem_id, local.address, local.size):
            return self._failure(f"local memory {local.mem_id} was deregistered")
        if not self._peer.registry.hold(remote.slot, remote.mem_id, remote.address, remote.size):
            own_table.release(local.slot)
            return self._failure(f"remote memory {remote.mem_id} of engine {remote.engine_key!r} "
                                 "was deregistered (or its engine closed)")
        return None

    def _failure(self, reason: str) -> tuple[int, str]:
        """A refused or cut-short copy's outcome: ERR_BAD_STATE when this engine is closing (a
        transfer taken off the queue just before close ends as close ends the queued ones)."""
        if self._engine.closed:
            return StatusCode.ERR_BAD_STATE, f"engine {self._engine.key!r} closed before the transfer completed"
        return StatusCode.ERR_RDMA_OP, reason

    def _let_go(self) -> None:
        self._peer.registry.release(self.remote_mem.slot)
        self._engine._own.registry.release(self.local_mem.slot)

    def _after_copy(self) -> tuple[int, str]:
        # A pid is reused only after its process died; if it is still alive now, every
        # byte copied went to the process the descriptor names.
        reason = self._peer.gone()
        if reason is not None:
            return self._failure(f"{reason} (it ended during the transfer)")
        return StatusCode.SUCCESS, ""


class CrossMemoryEngine(TransferEngine):
    """A transfer engine for processes on one host: one-sided copies by Linux cross-memory attach.

    Any contiguous CPU tensor can be registered, wherever the process allocated it; a peer
    engine that registered this engine's descriptor writes into it and reads from it with
    no help from this process. Attaching needs ptrace permission over the other process
    (same user with ``kernel.yama.ptrace_scope`` 0, or CAP_SYS_PTRACE); with
    ``allow_same_user_peers`` this process lets same-user processes attach to it under
    ptrace_scope 1 (it calls prctl(PR_SET_PTRACER_ANY), for the whole process).

    Deregistering memory, or closing, waits up to ``deregister_wait_s`` for peers' copies
    in flight into it; later transfers against it fail. A batch of at least
    ``PARALLEL_COPY_MIN_BYTES`` is split by bytes across ``copy_threads`` threads (the
    kernel pins and copies page by page, so one thread leaves memory bandwidth unused);
    by default as many as the cores this process may run on, at most two. Batches due
    at once are handed to the kernel together (a layer-by-layer transfer posted in a
    burst costs one hand-off, not one per layer). With ``pin_memory`` registered memory
    is locked resident (``resident.py``) until it is deregistered, as an RDMA
    registration pins it: a copy into a KV block that sat unused never waits for faults.
    With ``share_pages`` a registered tensor's whole pages are moved in place onto a sealed
    memfd (``shared_pages``: same addresses, same bytes) that peers map, so their copies
    into it are plain memory copies: a cross-process copy pins each 4 KiB page again on
    every call, which made it half as fast here. Register such a tensor before anything
    writes it and deregister it after (a KV cache at start and at shutdown): a write during
    either move could be lost. Memory that is not private anonymous memory, or that another
    registration covers, is registered as it is. Moving pages drops what the kernel knew of
    the old ones (another driver's pins, NUMA policy, huge pages). A process allowed to
    read this one's /proc/<pid>/fd can map shared pages, and a mapping outlives a later loss
    of that permission: share only with peers as trusted as the ptrace permission is.
    With ``inline_copies`` (by default when this process may run on one core only) a batch
    no fault delays is copied by the thread that posts it, and the status it returns is
    already final: where the worker could only take turns with the poster on the same
    core, it would add two thread hand-offs, each a wait for the GIL of up to its switch
    interval (5 ms) while the other thread runs Python.
    With ``copy_assist`` (by default with ``share_pages`` where the native module is built)
    the engine offers peers a job board (``copy_assist``): a peer's large write into shared
    pages is posted there, and ``help_writers``, called by a loop of this process that would
    otherwise only wait (vLLM's, while a request waits for that very KV), copies part of it on
    this process's core while the writer copies the rest. The writer waits for a helper for
    at most ``PeerBoard.FINISH_TIMEOUT_S`` after its own part, and fails the write after that.
    ``close`` fails every transfer still queued, stalled or held with ERR_BAD_STATE, stops
    the worker and copy threads and drops every fault rule.
    """

    PARALLEL_COPY_MIN_BYTES = 8 << 20
    #: At most this many due batches go to the kernel together (see ``_copy_together``).
    MAX_COALESCED = 64

    def __init__(self, key: str, host: str = "", port: int = 0, *, allow_same_user_peers: bool = False,
                 copy_threads: int | None = None, max_registrations: int = 1 << 16,
                 deregister_wait_s: float = 10.0, pin_memory: bool = True,
                 inline_copies: bool | None = None, share_pages: bool = False,
                 copy_assist: bool | None = None) -> None:
        problem = native_calls_problem()
        if problem is not None:
            raise CrossMemoryError(errno.ENOSYS, problem)
        if not isinstance(key, str) or not key:
            raise ValueError(f"engine key must be a non-empty string, got {key!r}")
        # Cores this process may use, not the host's: a server confined to one core gains
        # nothing from a second copy thread, or from a worker thread, but hand-offs.
        cores = len(os.sched_getaffinity(0)) or 1
        if copy_threads is None:
            copy_threads = min(2, cores)
        self.inline_copies = cores == 1 if inline_copies is None else bool(inline_copies)
        for name, value in (("copy_threads", copy_threads), ("max_registrations", max_registrations)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not deregister_wait_s >= 0:
            raise ValueError(f"deregister_wait_s must be >= 0 seconds, got {deregister_wait_s!r}")
        if copy_assist is None:
            copy_assist = bool(share_pages) and _assist.available()
        if copy_assist and not share_pages:
            raise ValueError("copy_assist needs share_pages: writers are helped only with copies into shared pages")
        self.key = key
        self.faults = LoopbackFaults()
        self._pin_memory = bool(pin_memory)
        self._share_pages = bool(share_pages)
        self._deregister_wait_s = float(deregister_wait_s)
        self._registry = PublishedRegistry(max_registrations)
        # The token also lives in this process's memory, where a peer's probe reads it.
        self._token_in_memory = ctypes.create_string_buffer(self._registry.token, TOKEN_BYTES)
        try:
            self._board = _assist.AssistBoard(CrossMemoryMemoryDesc.unpack) if copy_assist else None
        except BaseException:
            self._registry.close(0)
            raise
        offer = {} if self._board is None else dict(assist_fd=self._board.fd, assist_token=self._board.token)
        boot_id, pid_namespace = _host_identity()
        self._desc = CrossMemoryEngineDesc(
            key=key, pid=os.getpid(), boot_id=boot_id, pid_namespace=pid_namespace,
            registry_fd=self._registry.fd, token=self._registry.token,
            token_address=ctypes.addressof(self._token_in_memory),
            hostname=socket.gethostname(), host=host, port=int(port), **offer)
        if allow_same_user_peers:
            _allow_same_user_tracers()
        # This engine's own transfers hold its slots through an open of its own: OFD locks
        # of one open description do not exclude each other.
        self._own = _attach(self._desc, self._desc)
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._closed = False
        self._uids = itertools.count(1)
        self._mem_ids = itertools.count(1)
        self._memory: dict[int, _Registration] = {}
        self._peers: dict[str, _Peer] = {}
        self._sequence = 0
        self._due: list[tuple[float, int, _Posted]] = []
        self._stalled: list[_Posted] = []
        self._held: dict[int, _Posted] = {}
        self._together = threading.local()   # .held: this thread's posts inside posting_together
        self._copying = 0                     # threads in _outcomes now
        self._copies_done = threading.Condition()
        self._copy_threads = copy_threads
        self._copy_helpers: ThreadPoolExecutor | None = None  # made on the first large batch
        self._posted_for_help: set[_Posted] = set()   # writes on a peer's board, their memory held
        # Writes carried out with a peer's help: jobs, their pieces (``PeerBoard.finish``), and
        # the pieces the peer copied.
        self.assist_counts = {"jobs": 0, "pieces": 0, "pieces_by_peer": 0}
        self._worker = threading.Thread(target=self._run, name=f"cross-memory-{key}", daemon=True)
        self._worker.start()

    # -- descriptors and registration ------------------------------------------
    @property
    def closed(self) -> bool:
        return self._closed

    def get_engine_desc(self) -> CrossMemoryEngineDesc:
        return self._desc

    def unpack_engine_desc(self, packed: bytes) -> CrossMemoryEngineDesc:
        return CrossMemoryEngineDesc.unpack(packed)

    def unpack_memory_desc(self, packed: bytes) -> CrossMemoryMemoryDesc:
        return CrossMemoryMemoryDesc.unpack(packed)

    def register_remote_engine(self, desc: CrossMemoryEngineDesc) -> None:
        """Attach to a peer engine; raises ``CrossMemoryError`` saying why when it cannot be reached.

        Refused: another host or boot, another pid namespace, a process that is gone or is
        not that engine, or no ptrace permission over it (EPERM, with what would allow it).
        """
        if not isinstance(desc, CrossMemoryEngineDesc):
            raise TypeError(f"desc must be a CrossMemoryEngineDesc, got {type(desc).__name__}")
        self._require_open("register_remote_engine")
        if desc.key == self.key:
            if desc != self._desc:
                raise ValueError(f"engine key {desc.key!r} is this engine's own, but the descriptor is another's")
            return
        with self._lock:
            known = self._peers.get(desc.key)
        if known is not None and known.desc == desc and known.gone() is None:
            return
        peer = _attach(desc, self._desc)
        with self._lock:
            replaced, self._peers[desc.key] = self._peers.get(desc.key), peer
        if replaced is not None:
            replaced.withdraw()  # sessions to the engine this key named before now fail

    def deregister_remote_engine(self, desc: CrossMemoryEngineDesc) -> None:
        """Forget a peer engine; its sessions' later transfers fail."""
        if not isinstance(desc, CrossMemoryEngineDesc):
            raise TypeError(f"desc must be a CrossMemoryEngineDesc, got {type(desc).__name__}")
        with self._lock:
            peer = self._peers.pop(desc.key, None)
        if peer is not None:
            peer.withdraw()

    def prepare_remote_memory(self, mem: CrossMemoryMemoryDesc) -> None:
        """Map a registered peer's shared pages now (a handshake's work), so that the first
        session to them, made on the forward thread, finds them mapped. Never raises for a
        peer that is unknown or gone: its sessions will say so."""
        if not isinstance(mem, CrossMemoryMemoryDesc):
            raise TypeError(f"mem must be a CrossMemoryMemoryDesc, got {type(mem).__name__}")
        with self._lock:
            peer = self._peers.get(mem.engine_key)
        if mem.shares_pages and peer is not None and peer.desc.pid == mem.pid and peer.gone() is None:
            peer.pages_of(mem)

    def register_torch_tensor(self, tensor: torch.Tensor) -> CrossMemoryMemoryDesc:
        """Register a contiguous, non-empty CPU tensor so that peers can write into and read from it.

        Raises ``TypeError`` for a non-tensor and ``ValueError`` for a tensor that is not
        contiguous, not on the CPU or empty.
        """
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"tensor must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.device.type != "cpu":
            raise ValueError(f"CrossMemoryEngine moves host memory only; the tensor is on {tensor.device}")
        if not tensor.is_contiguous():
            raise ValueError(f"tensor of shape {tuple(tensor.shape)} with strides {tuple(tensor.stride())} "
                             "must be contiguous to be registered (register a contiguous byte view of it)")
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes == 0:
            raise ValueError("an empty tensor cannot be registered")
        self._require_open("register_torch_tensor")
        mem_id, address = next(self._mem_ids), tensor.data_ptr()
        claim = claim_memory(address, nbytes, self._share_pages)
        adopted = claim.adopted
        pinned = self._pin_memory and pin_pages(address, nbytes, f"engine {self.key!r}")
        registration = None
        try:
            slot = self._registry.publish(mem_id, address, nbytes)
            shared = {} if adopted is None else dict(shared_fd=adopted.fd, shared_token=adopted.token,
                                                     shared_start=adopted.start, shared_size=adopted.size)
            desc = CrossMemoryMemoryDesc(
                engine_key=self.key, mem_id=mem_id, slot=slot, pid=self._desc.pid, address=address, size=nbytes,
                dtype=str(tensor.dtype).removeprefix("torch."), shape=tuple(tensor.shape), **shared)
            registration = _Registration(desc, tensor, claim, pinned)
        finally:
            if registration is None:
                if pinned:
                    unpin_pages(address, nbytes)
                if not claim.release():
                    _lingering.append(tensor)
        if self._board is not None and adopted is not None:
            low = adopted.start - address
            try:
                self._board.add_dest(mem_id, address, low, low + adopted.size)
            except (OverflowError, RuntimeError) as exc:   # a full table (or closing): writers copy alone
                _log.warning("engine %r: memory %s gets no copy assist: %s", self.key, mem_id, exc)
        with self._lock:
            self._memory[mem_id] = registration
        return desc

    def deregister_memory(self, mem: CrossMemoryMemoryDesc) -> None:
        """Stop every transfer against ``mem``: waits for copies in flight, then later ones fail.

        Unknown (already deregistered) memory is ignored.
        """
        if not isinstance(mem, CrossMemoryMemoryDesc):
            raise TypeError(f"mem must be a CrossMemoryMemoryDesc, got {type(mem).__name__}")
        if mem.engine_key != self.key:
            raise ValueError(f"memory {mem.mem_id} belongs to engine {mem.engine_key!r}, not {self.key!r}")
        with self._lock:
            registration = self._memory.pop(mem.mem_id, None)
        if registration is None:
            return
        if self._board is not None:
            self._board.drop_dest(mem.mem_id)   # waits for a peer's job being helped into it
        copies_ended = self._registry.withdraw(registration.desc.slot, self._deregister_wait_s)
        if not copies_ended:
            _log.warning("memory %s of engine %r: a peer was still copying after %.1f s; it stays allocated",
                         mem.mem_id, self.key, self._deregister_wait_s)
        if not registration.let_go(copies_ended) or not copies_ended:
            _lingering.append(registration.tensor)

    def allocate_transfer_uid(self) -> int:
        with self._lock:
            return next(self._uids)

    # -- sessions ------------------------------------------------------------
    def create_session(self, local_mem, remote_mem) -> CrossMemorySession | None:
        """A session, or None when a region or the remote engine is not registered (logged)."""
        if not isinstance(local_mem, CrossMemoryMemoryDesc) or not isinstance(remote_mem, CrossMemoryMemoryDesc):
            raise TypeError(
                f"create_session needs two CrossMemoryMemoryDesc, got "
                f"{type(local_mem).__name__} and {type(remote_mem).__name__}")
        if self._closed:
            return None
        with self._lock:
            local = self._memory.get(local_mem.mem_id) if local_mem.engine_key == self.key else None
            peer = self._own if remote_mem.engine_key == self.key else self._peers.get(remote_mem.engine_key)
        if local is None:
            _log.warning("create_session: local memory %s is not registered with engine %r",
                         local_mem.mem_id, self.key)
            return None
        if peer is None or peer.desc.pid != remote_mem.pid:
            _log.warning("create_session: remote engine %r is not registered", remote_mem.engine_key)
            return None
        reason = peer.gone()
        if reason is not None:
            _log.warning("create_session: %s", reason)
            return None
        if not peer.registry.holds(remote_mem.slot, remote_mem.mem_id, remote_mem.address, remote_mem.size):
            _log.warning("create_session: memory %s of engine %r is not registered there",
                         remote_mem.mem_id, remote_mem.engine_key)
            return None
        return CrossMemorySession(self, local.desc, remote_mem, peer, local.claim.plain)

    # -- posting and completing ----------------------------------------------
    def _submit(self, session: CrossMemorySession, op: str, batch: CheckedBatch) -> LocalTransferStatus:
        status = LocalTransferStatus()
        closed_text = f"batch_{op}: engine {self.key!r} is closed"
        with self._lock:
            if self._closed:
                status.settle(StatusCode.ERR_BAD_STATE, closed_text)
                return status
            self._sequence += 1
            sequence = self._sequence
        verdict = self.faults.decide(PostedTransfer(sequence, op, batch.transfer_uid, session.remote_engine_key,
                                                    len(batch.sizes), batch.total_bytes))
        posted = _Posted(status, session, op, batch, verdict.failure, session._copies_here(batch))
        status.mark_in_progress()
        held = getattr(self._together, "held", None)
        if held is not None and verdict is NO_FAULT:
            # A large write goes on the peer's board now: the peer may copy it while this
            # thread posts the next ones. The rest is copied when posting_together ends.
            posted.job = self._post_for_help(posted)
            held.append((sequence, posted))   # goes with the others when posting_together ends
            return status
        if self.inline_copies and verdict is NO_FAULT:
            # Registrations are held for the copy, so a close meanwhile waits for it.
            code, message = self._outcomes([posted])[0]
            status.settle(code, message, posted.ended_at)
            return status
        with self._wake:
            if self._closed:
                status.settle(StatusCode.ERR_BAD_STATE, closed_text)
            elif verdict.stall:
                self._stalled.append(posted)
            elif verdict.hold is not None and verdict.hold.keep(functools.partial(self._release_held, sequence)):
                self._held[sequence] = posted  # under the lock, so a release cannot come first
            else:
                heapq.heappush(self._due, (time.monotonic() + verdict.delay_s, sequence, posted))
                self._wake.notify()
        return status

    @contextlib.contextmanager
    def posting_together(self):
        """Hold this thread's posts until the block ends, then hand them to the kernel together.

        For a caller that posts several batches in a row (a transfer's layers): one kernel
        call and one hand-off for all, inline or on the worker. Posts a fault delays, fails
        or holds go their own way at once; other threads' posts are not held. Nested blocks
        flush when the outermost ends, also when it ends by an exception, so every status
        still ends. A status posted inside must not be waited for inside: it cannot settle
        before the block ends.
        """
        together = self._together
        outermost = getattr(together, "held", None) is None
        if outermost:
            together.held = []
        try:
            yield
        finally:
            if outermost:
                held, together.held = together.held, None
                if held:
                    try:
                        self._flush(held)
                    except BaseException:
                        for _, posted in held:   # a status nobody settles would never end
                            self._give_up_help(posted)
                            posted.status.settle(StatusCode.ERR_BAD_STATE,
                                                 f"batch_{posted.op} uid {posted.batch.transfer_uid}: "
                                                 "the engine failed to carry it out")
                        raise

    def _flush(self, held: list[tuple[int, _Posted]]) -> None:
        if self.inline_copies:
            posts = [posted for _, posted in held]
            for posted, (code, message) in zip(posts, self._outcomes(posts)):
                posted.status.settle(code, message, posted.ended_at)
            return
        with self._wake:
            if not self._closed:
                now = time.monotonic()
                for sequence, posted in held:
                    heapq.heappush(self._due, (now, sequence, posted))
                self._wake.notify()
                return
        for _, posted in held:
            self._give_up_help(posted)
            posted.status.settle(StatusCode.ERR_BAD_STATE, f"batch_{posted.op} uid {posted.batch.transfer_uid}: "
                                 f"engine {self.key!r} closed before the transfer completed")

    def _release_held(self, sequence: int) -> None:
        with self._wake:
            posted = self._held.pop(sequence, None)  # None: close already failed it
            if posted is not None:
                heapq.heappush(self._due, (time.monotonic(), sequence, posted))
                self._wake.notify()

    #: How often an idle worker looks for peers that exited, to let go of their mapped pages.
    SWEEP_INTERVAL_S = 1.0

    def _sweep_peers(self) -> None:
        """Let go of the mapped pages of peers that exited or stopped registering them: a dead
        decode instance's KV cache must not stay resident because this process mapped it."""
        with self._lock:
            peers = list(self._peers.values())
        for peer in peers:
            try:
                if peer.gone() is None:     # gone() lets go of an exited peer's pages itself
                    peer.forget_stale_pages()
            except Exception:               # never let a sweep end the worker thread
                _log.exception("engine %r: looking for exited peers failed", self.key)

    def _next_due(self) -> list[_Posted] | None:
        """Every transfer whose time has come (at least one), waiting for one; None once the engine closes."""
        with self._wake:
            while not self._closed:
                if not self._due:
                    if not self._wake.wait(self.SWEEP_INTERVAL_S) and not self._due and not self._closed:
                        self._wake.release()
                        try:
                            self._sweep_peers()
                        finally:
                            self._wake.acquire()
                    continue
                now = time.monotonic()
                wait_s = self._due[0][0] - now
                if wait_s <= 0:
                    due = []
                    while self._due and self._due[0][0] <= now and len(due) < self.MAX_COALESCED:
                        due.append(heapq.heappop(self._due)[2])
                    return due
                self._wake.wait(wait_s)
        return None

    def _run(self) -> None:
        while (due := self._next_due()) is not None:
            outcomes = self._outcomes(due)
            statuses = [(posted.status, posted.ended_at) for posted in due]
            del due  # let go of the sessions before anyone woken by a status looks for them
            for (status, ended_at), (code, message) in zip(statuses, outcomes):
                status.settle(code, message, ended_at)
            del statuses

    def help_writers(self, wait_s: float = 0.0, linger_s: float = 0.0) -> int:
        """Copy part of the large writes peers are posting into this engine's memory now (copy
        assist); the ranges copied. ``wait_s``/``linger_s``: see ``AssistBoard.help``. For a
        loop with nothing better to do on its core: vLLM's engine loop asks for finished
        transfers without pause while a request waits for KV."""
        return 0 if self._board is None else self._board.help(wait_s, linger_s)

    def interrupt_help(self) -> None:
        """A ``help_writers`` call waiting for a write returns now (its loop has news to report)."""
        if self._board is not None:
            self._board.interrupt()

    def wait_for_copies(self, timeout_s: float) -> bool:
        """Block until no copy of this engine runs on any thread, at most ``timeout_s``; True if none runs.

        For a caller that would otherwise spin on the same core while a copy runs: vLLM's
        engine loop asks for finished transfers without pause while a request waits for
        its KV, and so took half the core from the thread copying that KV.
        """
        with self._copies_done:
            return self._copies_done.wait_for(lambda: self._copying == 0, timeout_s)

    def _outcomes(self, due: list[_Posted]) -> list[tuple[int, str]]:
        """(final code, message) of each transfer; copies bound for one process go as one run of syscalls."""
        with self._copies_done:
            self._copying += 1
        try:
            return self._outcomes_of(due)
        finally:
            with self._copies_done:
                self._copying -= 1
                if self._copying == 0:
                    self._copies_done.notify_all()

    def _outcomes_of(self, due: list[_Posted]) -> list[tuple[int, str]]:
        outcomes: list[tuple[int, str] | None] = [None] * len(due)
        groups: dict[tuple[str, int, bool], list[int]] = {}
        # Writes on a peer's board: taken first (close can no longer give them up), their pieces
        # left copied here, then each waits for the peer's piece in hand, if any; only then are
        # their registrations let go, so each end time is taken as its wait saw it end, not
        # after the others' bookkeeping. A job that never reaches its wait (an exception) is
        # given up, so its registrations go.
        taken = {index: self._take_job(posted) for index, posted in enumerate(due) if posted.job is not None}
        waited: list[tuple[int, tuple, object]] = []
        try:
            self._copy_left([(due[index], job) for index, job in taken.items() if job is not None])
            for index, posted in enumerate(due):
                if index in taken:
                    job = taken.pop(index)
                    ended = None                 # let go below, even if the wait is cut short
                    try:
                        ended = self._wait_for_helper(posted, job)
                    finally:
                        waited.append((index, job, ended))
                elif posted.failure is not None:
                    outcomes[index] = posted.failure.code, posted.failure.message
                else:
                    groups.setdefault((posted.op, posted.session.remote_mem.pid, posted.here), []).append(index)
        finally:
            for index, job in taken.items():
                if job is not None:
                    try:
                        self._give_up_taken(due[index], job)
                    except Exception:    # its registrations went all the same; the others still go
                        _log.exception("copy assist: giving up a job failed")
            for index, job, ended in waited:
                try:
                    outcomes[index] = self._after_help(due[index], job, ended)
                except Exception as exc:  # the other jobs are still let go
                    _log.exception("cross-memory transfer failed unexpectedly")
                    outcomes[index] = StatusCode.ERR_BAD_STATE, str(exc)
        for (op, pid, here), members in groups.items():
            try:
                for index, outcome in zip(members, self._copy_together(op, pid, here, [due[i] for i in members])):
                    outcomes[index] = outcome
            except Exception as exc:  # never let one transfer end the worker thread
                _log.exception("cross-memory transfer failed unexpectedly")
                for index in members:
                    outcomes[index] = StatusCode.ERR_BAD_STATE, str(exc)
        labelled = []
        for posted, (code, message) in zip(due, outcomes):
            label = f"batch_{posted.op} uid {posted.batch.transfer_uid}"
            labelled.append((code, f"{label}: {message}" if message else ""))
        return labelled

    def _copy_together(self, op: str, pid: int, here: bool, group: list[_Posted]) -> list[tuple[int, str]]:
        """Carry out batches bound for process ``pid`` while each one's registrations are held.

        With ``here`` the peer's memory is mapped in this process and the copies are memory
        copies; else one kernel call covers many batches (their ranges given as absolute
        addresses), which saves a thread hand-off and a call per batch when several are due
        at once. If that call fails, each batch is carried out alone again, so each gets its
        own outcome (a copy is idempotent: bytes already moved are moved again to the same place).
        """
        outcomes: list[tuple[int, str] | None] = []
        held = []
        for posted in group:
            problem = posted.session._hold()
            outcomes.append(problem)
            if problem is None:
                held.append(posted)
        try:
            copied = set()
            failed = self._copy_with_assist(held) if here and op == "write" and held else None
            if failed is not None:       # the peer helped: done, or failed for all
                copied = {id(posted) for posted in held}
                for index, posted in enumerate(group):
                    if failed and outcomes[index] is None:
                        outcomes[index] = posted.session._failure(failed)
            elif len(held) > 1 or (here and held):
                ranges = _absolute_ranges(held, here)
                try:
                    self._move(op, None if here else pid, 0, 0, *ranges)
                    copied = {id(posted) for posted in held}
                except CrossMemoryError:
                    pass  # each batch on its own below
            for index, posted in enumerate(group):
                if outcomes[index] is not None or id(posted) in copied:
                    continue
                session, batch = posted.session, posted.batch
                reason = session._why_dead()      # killed while the joint call ran: copy nothing more
                if reason is not None:
                    outcomes[index] = session._failure(reason)
                    continue
                try:
                    remote_base = session.mapped_remote_address if here else session.remote_mem.address
                    self._move(op, None if here else pid, session.local_mem.address, remote_base,
                               batch.local_offsets, batch.remote_offsets, batch.sizes, batch.total_bytes)
                except CrossMemoryError as exc:
                    outcomes[index] = session._failure(str(exc))
            # When these copies ended: before their registrations are let go, which is not copying.
            copied_at = time.monotonic()
            for posted in group:
                posted.ended_at = copied_at
        finally:
            for posted in held:
                posted.session._let_go()
        return [outcome if outcome is not None else posted.session._after_copy()
                for posted, outcome in zip(group, outcomes)]

    #: Writes smaller than this are copied here alone: a job and a wake-up cost more than they save.
    ASSIST_MIN_BYTES = 1 << 20

    def _post_for_help(self, posted: _Posted):
        """Hold the registrations of a large write and put it on the peer's board; (board, job),
        or None (nothing held) where the write is not for help or the board is full."""
        session, batch = posted.session, posted.batch
        board = session._peer.board
        if (posted.op != "write" or not posted.here or board is None or batch.total_bytes < self.ASSIST_MIN_BYTES
                or len(batch.sizes) > board.MAX_RANGES or not session.helpable(batch)):
            return None
        if session._hold() is not None:
            return None          # refused: the copy at the end says why
        job = None
        try:
            job = board.post([session.assist_segment()], [0] * len(batch.sizes), batch.local_offsets,
                             batch.remote_offsets, batch.sizes)
        finally:
            if job is None:
                session._let_go()
        if job is None:
            return None
        with self._lock:
            self._posted_for_help.add(posted)   # close gives up what is still posted
        return board, job

    @staticmethod
    def _copy_left(taken: list[tuple[_Posted, tuple]]) -> None:
        """Copy the unclaimed pieces of taken jobs (posted, (board, job)) in one call without the
        GIL, last slot first: the peer works through a board from the first, so the two meet in
        one job. A session killed meanwhile stops its jobs between two pieces (its stop word)."""
        live = [(posted, job) for posted, (_, job) in taken if posted.session._why_dead() is None]
        live.sort(key=lambda item: _assist.job_slot(item[1]), reverse=True)
        if not live:
            return
        try:
            _assist.copy_left([job for _, job in live], [posted.session.stop_word for posted, _ in live])
        except Exception:   # each job's finish still copies what is left
            _log.exception("copy assist: copying the pieces left failed")

    def _wait_for_helper(self, posted: _Posted, taken: tuple | None):
        """Copy what is still left of a write posted for help (``taken``: its board and job, None
        if close gave it up) and wait for the peer's part, noting when the wait saw it end (jobs
        are waited for in turn, so a later one may have ended a little earlier); what
        ``_after_help`` needs. Never raises, lets go of nothing.

        A session killed (or a peer gone) since the post copies nothing more: the job is given up."""
        if taken is None:
            return None
        board, job = taken
        session = posted.session
        peer = session._peer
        try:
            reason = session._why_dead()
            by_peer, pieces = board.finish(job, peer.pidfd if peer.gone() is None else -1, copy=reason is None)
        except OSError as exc:          # TimeoutError, ProcessLookupError
            return exc.with_traceback(None)
        except Exception as exc:        # a bug: said with its traceback as text, so that a kept
            # log record does not keep the job's frames, and with them the board's mapping, alive
            _log.error("cross-memory transfer failed unexpectedly:\n%s", "".join(traceback.format_exception(exc)))
            return exc.with_traceback(None)
        posted.ended_at = time.monotonic()
        return by_peer, pieces, reason

    def _after_help(self, posted: _Posted, taken: tuple | None, ended) -> tuple[int, str]:
        """Let go of a write posted for help once ``_wait_for_helper`` saw it end (``ended``: what
        it returned; None: it never ran); the outcome."""
        session = posted.session
        if taken is None:                  # given up by close meanwhile
            return session._failure(f"engine {self.key!r} closed before the transfer completed")
        if ended is None:                  # an exception came before the wait: nothing more is copied
            try:
                self._give_up_taken(posted, taken)
            except RuntimeError:           # it was finished already; its registrations went all the same
                pass
            return StatusCode.ERR_BAD_STATE, "the engine failed to carry it out"
        session._let_go()
        if isinstance(ended, OSError):
            return session._failure(f"{ended} (engine {session._peer.desc.key!r})")
        if isinstance(ended, BaseException):  # a bug, logged by the wait: this transfer fails alone
            return StatusCode.ERR_BAD_STATE, str(ended)
        by_peer, pieces, reason = ended
        self._count_assisted(pieces, by_peer)
        reason = reason or session._why_dead()   # or killed while the copy ran
        return session._failure(reason) if reason is not None else session._after_copy()

    def _take_job(self, posted: _Posted) -> tuple | None:
        """The (board, job) of a write posted for help, taken once: by its copy, or by close."""
        with self._lock:
            taken, posted.job = posted.job, None
            self._posted_for_help.discard(posted)
        return taken

    def _give_up_help(self, posted: _Posted) -> None:
        """A write posted for help that ends without its copy: take it off the board, let go."""
        taken = self._take_job(posted)
        if taken is not None:
            self._give_up_taken(posted, taken)

    @staticmethod
    def _give_up_taken(posted: _Posted, taken: tuple) -> None:
        """Take a taken job off the board without copying (the peer's piece in hand is waited
        for), then let go of its registrations."""
        board, job = taken
        try:
            board.finish(job, -1, copy=False)
        except OSError:
            pass          # the helper did not leave in time: nothing more can be done for it
        finally:
            posted.session._let_go()

    def _copy_with_assist(self, held: list[_Posted]) -> str | None:
        """Copy held writes into one peer together with that peer (copy assist).

        None: not assisted (no board, too small, too many ranges, a full board), so the caller
        copies as usual; "": every byte landed; else why they may not have (for every batch).
        """
        peer = held[0].session._peer
        board = peer.board
        if board is None or sum(posted.batch.total_bytes for posted in held) < self.ASSIST_MIN_BYTES:
            return None
        segments: list[tuple] = []
        segment_of_session: dict[int, int] = {}
        segment_of, src, dst, sizes = [], [], [], []
        for posted in held:
            session, batch = posted.session, posted.batch
            if session._peer is not peer or not session.helpable(batch):
                return None   # the peer could not read this memory
            index = segment_of_session.get(id(session))
            if index is None:
                index = segment_of_session[id(session)] = len(segments)
                segments.append(session.assist_segment())
            segment_of.extend([index] * len(batch.sizes))
            src.extend(batch.local_offsets)
            dst.extend(batch.remote_offsets)
            sizes.extend(batch.sizes)
        if len(sizes) > board.MAX_RANGES or len(segments) > board.MAX_SEGMENTS:
            return None
        job = board.post(segments, segment_of, src, dst, sizes)
        if job is None:
            return None
        try:
            by_peer, pieces = board.finish(job, peer.pidfd if peer.gone() is None else -1)
        except OSError as exc:            # TimeoutError, ProcessLookupError
            return f"{exc} (engine {peer.desc.key!r})"
        self._count_assisted(pieces, by_peer)
        return ""

    def _count_assisted(self, pieces: int, by_peer: int) -> None:
        with self._lock:
            counts = self.assist_counts
            counts["jobs"] += 1
            counts["pieces"] += pieces
            counts["pieces_by_peer"] += by_peer

    def _move(self, op: str, pid: int | None, local_base: int, remote_base: int,
              lo: list[int], ro: list[int], sizes: list[int], total_bytes: int) -> None:
        """Carry out ranges' copies on this thread, and on helper threads when they are many bytes.

        ``pid`` None: both sides are mapped in this process (memory copies); else the kernel
        copies to or from process ``pid``. Runs while the registrations are held, so helpers
        need no locks of their own. The first error by range order is raised.
        """
        if pid is None:
            move = functools.partial(_copy_here, op)
        else:
            move = functools.partial(move_ranges, iovec.SYSCALLS[op], pid, op)
        parts = min(self._copy_threads, len(sizes))
        if parts < 2 or total_bytes < self.PARALLEL_COPY_MIN_BYTES:
            move(local_base, remote_base, lo, ro, sizes)
            return
        # Posting threads and the worker can both get here first: one pool, made once, and
        # sized for the engine, so that a first batch of two ranges caps no later one.
        with self._lock:
            if self._copy_helpers is None:
                self._copy_helpers = ThreadPoolExecutor(self._copy_threads - 1,
                                                        thread_name_prefix=f"cross-memory-{self.key}-copy")
            helpers_pool = self._copy_helpers
        # Cut where the running byte count passes each equal share.
        cuts, share, running = [0], total_bytes / parts, 0
        for index, size in enumerate(sizes):
            running += size
            if len(cuts) < parts and running >= share * len(cuts):
                cuts.append(index + 1)
        cuts.append(len(sizes))
        slices = [(a, b) for a, b in zip(cuts, cuts[1:]) if a < b]

        def part(a: int, b: int) -> Exception | None:
            # Any error is returned, not raised, so that every part has ended before the
            # caller lets go of the registrations the helpers still copy into.
            try:
                move(local_base, remote_base, lo[a:b], ro[a:b], sizes[a:b], range_base=a, bytes_base=sum(sizes[:a]))
            except Exception as exc:       # noqa: BLE001 - re-raised below, once all parts ended
                return exc
            return None

        helpers = [helpers_pool.submit(part, a, b) for a, b in slices[1:]]
        errors = [part(*slices[0])] + [helper.result() for helper in helpers]
        first = next((error for error in errors if error is not None), None)
        if first is not None:
            raise first

    def _require_open(self, what: str) -> None:
        if self._closed:
            raise RuntimeError(f"{what}: engine {self.key!r} is closed")

    def close(self) -> None:
        with self._wake:
            if self._closed:
                return
            self._closed = True
            abandoned = [entry[2] for entry in self._due] + self._stalled + list(self._held.values())
            self._due, self._stalled, self._held = [], [], {}
            self._wake.notify_all()
        with self._lock:
            abandoned += [posted for posted in self._posted_for_help if posted not in abandoned]
        for posted in abandoned:
            self._give_up_help(posted)
            posted.status.settle(StatusCode.ERR_BAD_STATE,
                                 f"batch_{posted.op} uid {posted.batch.transfer_uid}: engine {self.key!r} "
                                 "closed before the transfer completed")
        if threading.current_thread() is not self._worker:
            self._worker.join()
        if self._board is not None:
            self._board.close()          # after the job being helped: no copy into our memory after this
        with self._lock:
            registrations, self._memory = list(self._memory.values()), {}
            peers, self._peers = list(self._peers.values()), {}
        copies_ended = self._registry.close(self._deregister_wait_s)
        if not copies_ended:
            _log.warning("engine %r closed while a peer was still copying; its memory stays allocated", self.key)
        for registration in registrations:
            if not registration.let_go(copies_ended) or not copies_ended:
                _lingering.append(registration.tensor)
        for peer in peers:
            peer.withdraw()
            peer.close()
        self._own.close()
        if self._copy_helpers is not None:
            self._copy_helpers.shutdown(wait=True)
        # Predicates may capture sessions and tensors; no transfer can use them now.
        self.faults.clear()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<CrossMemoryEngine {self.key!r} pid={self._desc.pid} {state}>"

"""CrossMemoryEngine: one-sided writes and reads between processes on one host, into tensors the other allocated.

Rules: mori's status semantics (posting returns at once, one worker thread settles each batch, bad values give
already-failed statuses); bytes move only while both registrations are held in their owners' tables (``registry``),
by one of the copy strategies (``strategy.py``); faults come from ``engine.faults`` as in LoopbackEngine; the
engine's numbers are its ``tuning`` (``tuning.py``).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import os
import socket
import threading
from dataclasses import replace
from typing import Any

import torch

from ..base import EngineBase
from ..checks import CheckedBatch, check_registrable
from ..copy_split import CopyHelpers
from ..faults import NO_FAULT, LoopbackFaults, PostedTransfer
from ..inflight import PostQueue, serve
from ..status import LocalTransferStatus, StatusCode
from .assisted import AssistedCopy
from .copy_assist import AssistBoard
from .copy_assist import available as assist_available
from .copy_runner import CopyRunner
from .copying import KernelCopy, PageCopy
from .descriptors import CrossMemoryEngineDesc, CrossMemoryMemoryDesc
from .iovec import CrossMemoryError, native_calls_problem
from .peers import Peer, allow_same_user_tracers, attach, host_identity
from .registrations import Registrations
from .registry import TOKEN_BYTES, PublishedRegistry
from .session import CrossMemorySession, SameHostPost
from .tuning import Tuning

__all__ = ["CrossMemoryEngine"]

_log = logging.getLogger(__name__)


class _Together(threading.local):
    held: list[tuple[int, SameHostPost]] | None = (
        None  # this thread's posts inside posting_together
    )


class CrossMemoryEngine(EngineBase[CrossMemoryEngineDesc, CrossMemoryMemoryDesc]):
    """A transfer engine for processes on one host: one-sided copies into the peer's process.

    Any contiguous CPU tensor can be registered, wherever the process allocated it; a peer
    engine that registered this engine's descriptor writes into it and reads from it with
    no help from this process. Attaching needs ptrace permission over the other process
    (same user with ``kernel.yama.ptrace_scope`` 0, or CAP_SYS_PTRACE); with
    ``allow_same_user_peers`` this process lets same-user processes attach to it under
    ptrace_scope 1 (it calls prctl(PR_SET_PTRACER_ANY), for the whole process).

    How bytes move is a strategy (``strategy.py``), chosen by the memory's owner: by the kernel
    (process_vm_writev/readv) by default; with ``share_pages`` a registered tensor's whole pages
    are moved in place onto a sealed memfd (``shared_pages``: same addresses, same bytes) that
    peers map, so their copies are memory copies. Register such a tensor before anything writes it
    and deregister it after (a KV cache at start and at shutdown): a write during either move could
    be lost. A process allowed to read this one's /proc/<pid>/fd can map shared pages: share only
    with peers as trusted as the ptrace permission is. With ``copy_assist`` (by default with
    ``share_pages`` where the native module is built) the engine offers peers a job board, and
    ``help_writers``, called by a loop that would otherwise only wait, copies part of a peer's
    large write into shared pages on this process's core.

    Deregistering memory, or closing, waits up to ``deregister_wait_s`` for peers' copies in
    flight into it; later transfers against it fail. A large batch is split across
    ``copy_threads`` threads (by default as many as the cores this process may run on, at most
    two); batches due at once go together (one kernel call for a transfer's layers). With
    ``pin_memory`` registered memory is locked resident (``resident.py``), as an RDMA
    registration pins it. With ``inline_copies`` (by default when this process may run on one
    core only) a batch no fault delays is copied by the thread that posts it: a worker thread
    would only take turns with the poster on that core, each hand-off a wait for the GIL.
    ``close`` fails every transfer still queued, stalled or held with ERR_BAD_STATE, stops
    the worker and copy threads and drops every fault rule.
    """

    engine_desc_type = CrossMemoryEngineDesc
    memory_desc_type = CrossMemoryMemoryDesc

    def __init__(
        self,
        key: str,
        host: str = "",
        port: int = 0,
        *,
        allow_same_user_peers: bool = False,
        copy_threads: int | None = None,
        max_registrations: int = 1 << 16,
        deregister_wait_s: float = 10.0,
        pin_memory: bool = True,
        inline_copies: bool | None = None,
        share_pages: bool = False,
        copy_assist: bool | None = None,
        tuning: Tuning | None = None,
    ) -> None:
        problem = native_calls_problem()
        if problem is not None:
            raise CrossMemoryError(errno.ENOSYS, problem)
        super().__init__(key)
        # Cores this process may use, not the host's: a server confined to one core gains
        # nothing from a second copy thread, or from a worker thread, but hand-offs.
        cores = len(os.sched_getaffinity(0)) or 1
        copy_threads = min(2, cores) if copy_threads is None else copy_threads
        self.inline_copies = cores == 1 if inline_copies is None else bool(inline_copies)
        _check_options(copy_threads, max_registrations, deregister_wait_s, share_pages, copy_assist)
        if copy_assist is None:
            copy_assist = bool(share_pages) and assist_available()
        #: This engine's numbers (its own copy: changing them changes no other engine's).
        self.tuning = replace(tuning) if tuning is not None else Tuning()
        self.faults: LoopbackFaults = LoopbackFaults()
        table = PublishedRegistry(max_registrations)
        # The token also lives in this process's memory, where a peer's probe reads it.
        self._token_in_memory = ctypes.create_string_buffer(table.token, TOKEN_BYTES)
        try:
            self._board = AssistBoard(CrossMemoryMemoryDesc.unpack) if copy_assist else None
        except BaseException:
            table.close(0)
            raise
        self._desc = self._describe(table, host, port)
        self._memory = Registrations(
            key,
            self._desc.pid,
            table,
            share_pages=bool(share_pages),
            pin_memory=bool(pin_memory),
            deregister_wait_s=float(deregister_wait_s),
        )
        if allow_same_user_peers:
            allow_same_user_tracers()
        # This engine's own transfers hold its slots through an open of its own: OFD locks
        # of one open description do not exclude each other.
        self._own = attach(self._desc, self._desc)
        self._lock = threading.Lock()
        self._peers: dict[str, Peer] = {}
        self._queue: PostQueue[SameHostPost] = PostQueue(most=self.tuning.max_coalesced)
        self._together = _Together()
        self._start_copying(copy_threads)
        self._worker = threading.Thread(
            target=serve,
            args=(self._queue, self._copier.outcomes),
            kwargs=dict(idle_s=self.tuning.sweep_interval_s, on_idle=self._sweep_peers),
            name=f"cross-memory-{key}",
            daemon=True,
        )
        self._worker.start()

    def _start_copying(self, copy_threads: int) -> None:
        """The copy threads, the three strategies and what runs them."""
        self._helpers = CopyHelpers(copy_threads, f"cross-memory-{self.key}")
        self._kernel = KernelCopy(self._helpers, self.tuning)
        self._pages = PageCopy(self._helpers, self.tuning)
        self._assisted = AssistedCopy(self.key, self.tuning)
        self._copier = CopyRunner(self._kernel, self._pages, self._assisted)

    def _describe(self, table: PublishedRegistry, host: str, port: int) -> CrossMemoryEngineDesc:
        offer: dict[str, Any] = (
            {}
            if self._board is None
            else dict(assist_fd=self._board.fd, assist_token=self._board.token)
        )
        boot_id, pid_namespace = host_identity()
        return CrossMemoryEngineDesc(
            key=self.key,
            pid=os.getpid(),
            boot_id=boot_id,
            pid_namespace=pid_namespace,
            registry_fd=table.fd,
            token=table.token,
            token_address=ctypes.addressof(self._token_in_memory),
            hostname=socket.gethostname(),
            host=host,
            port=int(port),
            **offer,
        )

    @property
    def assist_counts(self) -> dict[str, int]:
        """Writes carried out with a peer's help: jobs, their pieces, and the pieces the peer copied."""
        return self._assisted.counts

    # -- peers -----------------------------------------------------------------------------------
    def register_remote_engine(self, desc: CrossMemoryEngineDesc) -> None:
        """Attach to a peer engine; raises ``CrossMemoryError`` saying why when it cannot be reached.

        Refused: another host or boot, another pid namespace, a process that is gone or is
        not that engine, or no ptrace permission over it (EPERM, with what would allow it).
        """
        done, _ = self._known_remote(desc, self._peers, self._lock)
        if done:
            return
        peer = attach(desc, self._desc)
        with self._lock:
            replaced, self._peers[desc.key] = self._peers.get(desc.key), peer
        if replaced is not None:
            replaced.withdraw()  # sessions to the engine this key named before now fail

    def deregister_remote_engine(self, desc: CrossMemoryEngineDesc) -> None:
        """Forget a peer engine; its sessions' later transfers fail."""
        self._check_engine_desc(desc)
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
        if (
            mem.shares_pages
            and peer is not None
            and peer.desc.pid == mem.pid
            and peer.gone() is None
        ):
            peer.pages_of(mem)

    def _sweep_peers(self) -> None:
        """Let go of the mapped pages of peers that exited or stopped registering them: a dead
        decode instance's KV cache must not stay resident because this process mapped it."""
        with self._lock:
            peers = list(self._peers.values())
        for peer in peers:
            try:
                if peer.gone() is None:  # gone() lets go of an exited peer's pages itself
                    peer.forget_stale_pages()
            except Exception:  # never let a sweep end the worker thread
                _log.exception("engine %r: looking for exited peers failed", self.key)

    # -- this engine's memory and sessions -------------------------------------------------------
    def register_torch_tensor(self, tensor: torch.Tensor) -> CrossMemoryMemoryDesc:
        """Register a contiguous, non-empty CPU tensor so that peers can write into and read from it.

        Raises ``TypeError`` for a non-tensor and ``ValueError`` for a tensor that is not
        contiguous, not on the CPU or empty.
        """
        nbytes = check_registrable(tensor, "CrossMemoryEngine")
        self._require_open("register_torch_tensor")
        return self._memory.add(tensor, nbytes, self._board)

    def deregister_memory(self, mem: CrossMemoryMemoryDesc) -> None:
        """Stop every transfer against ``mem``: waits for copies in flight, then later ones fail.

        Unknown (already deregistered) memory is ignored.
        """
        self._check_memory_desc(mem)
        self._memory.remove(mem.mem_id, self._board)

    def create_session(self, local_mem, remote_mem) -> CrossMemorySession | None:
        """A session, or None when a region or the remote engine is not registered (logged)."""
        self._check_session_descs(local_mem, remote_mem)
        if self._closed:
            return None
        local = self._memory.get(local_mem.mem_id) if local_mem.engine_key == self.key else None
        with self._lock:
            peer = (
                self._own
                if remote_mem.engine_key == self.key
                else self._peers.get(remote_mem.engine_key)
            )
        if local is None:
            _log.warning(
                "create_session: local memory %s is not registered with engine %r",
                local_mem.mem_id,
                self.key,
            )
            return None
        if peer is None or peer.desc.pid != remote_mem.pid:
            _log.warning(
                "create_session: remote engine %r is not registered", remote_mem.engine_key
            )
            return None
        reason = peer.gone()
        if reason is not None:
            _log.warning("create_session: %s", reason)
            return None
        if not peer.registry.holds(
            remote_mem.slot, remote_mem.mem_id, remote_mem.address, remote_mem.size
        ):
            _log.warning(
                "create_session: memory %s of engine %r is not registered there",
                remote_mem.mem_id,
                remote_mem.engine_key,
            )
            return None
        return CrossMemorySession(
            self, local.desc, remote_mem, peer, self._own.registry, local.claim.plain
        )

    # -- posting ---------------------------------------------------------------------------------
    def _submit(
        self, session: CrossMemorySession, op: str, batch: CheckedBatch
    ) -> LocalTransferStatus:
        status = LocalTransferStatus()
        sequence = self._queue.number()
        if sequence is None:
            status.settle(StatusCode.ERR_BAD_STATE, f"batch_{op}: engine {self.key!r} is closed")
            return status
        verdict = self.faults.decide(
            PostedTransfer(
                sequence,
                op,
                batch.transfer_uid,
                session.remote_engine_key,
                len(batch.sizes),
                batch.total_bytes,
            )
        )
        posted = SameHostPost(
            status, session, op, batch, verdict.failure, here=session.copies_here(batch)
        )
        status.mark_in_progress()
        held = self._together.held
        if held is not None and verdict is NO_FAULT:
            # A large write goes on the peer's board now: the peer may copy it while this
            # thread posts the next ones. The rest is copied when posting_together ends.
            posted.job = self._assisted.post_early(posted)
            held.append((sequence, posted))
        elif self.inline_copies and verdict is NO_FAULT:
            # Registrations are held for the copy, so a close meanwhile waits for it.
            posted.settle(*self._copier.outcomes([posted])[0])
        elif not self._queue.put(posted, sequence, verdict):
            status.settle(StatusCode.ERR_BAD_STATE, f"batch_{op}: engine {self.key!r} is closed")
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
        outermost = together.held is None
        if outermost:
            together.held = []
        try:
            yield
        finally:
            if outermost:
                held, together.held = together.held, None
                if held:
                    self._flush(held)

    def _flush(self, held: list[tuple[int, SameHostPost]]) -> None:
        try:
            if self.inline_copies:
                posts = [posted for _, posted in held]
                for posted, outcome in zip(posts, self._copier.outcomes(posts)):
                    posted.settle(*outcome)
            elif not self._queue.put_due(held):
                for _, posted in held:
                    self._assisted.give_up(posted)
                    posted.fail_closed(self.key)
        except BaseException:
            for _, posted in held:  # a status nobody settles would never end
                self._assisted.give_up(posted)
                posted.settle(StatusCode.ERR_BAD_STATE, "the engine failed to carry it out")
            raise

    # -- hooks for a serving loop on this process's core -----------------------------------------
    def help_writers(self, wait_s: float | None = None, linger_s: float | None = None) -> int:
        """Copy part of the large writes peers are posting into this engine's memory now (copy
        assist); the ranges copied. ``wait_s``/``linger_s``: see ``AssistBoard.help`` (None: the
        tuning's). For a loop with nothing better to do on its core: vLLM's engine loop asks for
        finished transfers without pause while a request waits for KV."""
        if self._board is None:
            return 0
        tuning = self.tuning
        return self._board.help(
            tuning.assist_wait_s if wait_s is None else wait_s,
            tuning.assist_linger_s if linger_s is None else linger_s,
        )

    def interrupt_help(self) -> None:
        """A ``help_writers`` call waiting for a write returns now (its loop has news to report)."""
        if self._board is not None:
            self._board.interrupt()

    def wait_for_copies(self, timeout_s: float | None = None) -> bool:
        """Block until no copy of this engine runs on any thread, at most ``timeout_s`` (None: the
        tuning's); True if none runs. For a caller that would otherwise spin on the core a copy needs."""
        return self._copier.wait_idle(self.tuning.copy_wait_s if timeout_s is None else timeout_s)

    # -- closing ---------------------------------------------------------------------------------
    def close(self) -> None:
        self._closed = True
        abandoned = self._queue.close()
        if abandoned is None:
            return
        abandoned += [posted for posted in self._assisted.still_posted() if posted not in abandoned]
        for posted in abandoned:
            self._assisted.give_up(posted)
            posted.fail_closed(self.key)
        if threading.current_thread() is not self._worker:
            self._worker.join()
        if self._board is not None:
            self._board.close()  # after the job being helped: no copy into our memory after this
        with self._lock:
            peers, self._peers = list(self._peers.values()), {}
        self._memory.close()
        for peer in peers:
            peer.withdraw()
            peer.close()
        self._own.close()
        self._helpers.shutdown()
        # Predicates may capture sessions and tensors; no transfer can use them now.
        self.faults.clear()


def _check_options(
    copy_threads: Any,
    max_registrations: Any,
    deregister_wait_s: Any,
    share_pages: bool,
    copy_assist: bool | None,
) -> None:
    for name, value in (("copy_threads", copy_threads), ("max_registrations", max_registrations)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if not deregister_wait_s >= 0:
        raise ValueError(f"deregister_wait_s must be >= 0 seconds, got {deregister_wait_s!r}")
    if copy_assist and not share_pages:
        raise ValueError(
            "copy_assist needs share_pages: writers are helped only with copies into shared pages"
        )

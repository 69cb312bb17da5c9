"""The same-host engine's peers: attaching to another engine's process, and what this one holds of it (a pidfd,
its registration table, its shared pages mapped here, its copy-assist board).

Rules: attaching proves the permission and the process (its token is read out of its memory), refusing another
host, boot or pid namespace with the reason; a peer's handles close with the engine or once no session uses it;
a peer whose process exited lets go of its mapped pages at once.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import select
import threading
import weakref

from ..shared_memory import RegionUnavailable
from .copy_assist import PeerBoard
from .copy_assist import available as assist_available
from .descriptors import CrossMemoryEngineDesc, CrossMemoryMemoryDesc
from .iovec import SYSCALLS, CrossMemoryError, move_ranges
from .registry import TOKEN_BYTES, RegistryUnavailable, RegistryView
from .shared_pages import PeerPages

__all__ = ["Peer", "allow_same_user_tracers", "attach", "host_identity"]

_log = logging.getLogger(__name__)

# prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY): Yama's per-process opt-in for ptrace_scope 1.
_PR_SET_PTRACER = 0x59616D61
_PR_SET_PTRACER_ANY = ctypes.c_ulong(-1).value


def host_identity() -> tuple[str, int]:
    """This boot of this host, and this process's pid namespace: a pid means something only within both."""
    with open("/proc/sys/kernel/random/boot_id") as handle:
        boot_id = handle.read().strip()
    return boot_id, os.stat("/proc/self/ns/pid").st_ino


def allow_same_user_tracers() -> None:
    """Let same-user processes attach to this one under Yama ptrace_scope 1 (a no-op without Yama)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PTRACER, ctypes.c_ulong(_PR_SET_PTRACER_ANY), 0, 0, 0) != 0:
        if ctypes.get_errno() != errno.EINVAL:  # EINVAL: no Yama, so nothing to relax
            _log.warning("prctl(PR_SET_PTRACER_ANY) failed: %s", os.strerror(ctypes.get_errno()))


def _close_peer_handles(pidfd: int, registry: RegistryView) -> None:
    os.close(pidfd)
    registry.close()


class Peer:
    """An engine this one can reach: a pidfd on its process and an open of its registration table.

    The handles are closed at engine close, or once no session uses the peer any more.
    """

    def __init__(
        self,
        desc: CrossMemoryEngineDesc,
        pidfd: int,
        registry: RegistryView,
        *,
        use_board: bool = True,
    ) -> None:
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
        self._introduced: set[tuple] = set()  # this engine's registrations announced to its board
        # Where its process helps with writes into it (None: this engine copies them alone).
        self.board: PeerBoard | None = None
        if use_board and desc.assist_fd >= 0 and assist_available():
            try:
                self.board = PeerBoard(desc.pid, desc.assist_fd, desc.assist_token)
            except (RegionUnavailable, OSError, ValueError) as exc:
                _log.warning(
                    "engine %r offers copy assist, but its board cannot be mapped here (%s); writes "
                    "into it are copied here alone",
                    desc.key,
                    exc,
                )

    def introduce(self, segment: tuple) -> None:
        """Announce one of this engine's registrations on the peer's board, once per registration."""
        key = segment[:3]  # pid, mem_id, token
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
            mapping = PeerPages(
                mem.pid, mem.shared_fd, mem.shared_token, mem.shared_size, mem.shared_start
            )
        except (RegionUnavailable, OSError) as exc:
            # Said once per memory: a failure is retried after each sweep, under traffic too.
            said = mem.mem_id in self._refusals_said
            self._refusals_said.add(mem.mem_id)
            (_log.debug if said else _log.warning)(
                "memory %s of engine %r: its shared pages cannot be mapped (%s); the kernel copies into it "
                "instead",
                mem.mem_id,
                self.desc.key,
                exc,
            )
        if self.gone() is not None:  # the pid may have been someone else's when the fd was opened
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
        stale = [
            mem_id
            for mem_id, (desc, mapping) in known
            if mapping is None
            or not self.registry.holds(desc.slot, desc.mem_id, desc.address, desc.size)
        ]
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
        self.board = None  # a job posted there keeps the mapping until it ends
        self._handles()


def attach(desc: CrossMemoryEngineDesc, own: CrossMemoryEngineDesc) -> Peer:
    """Check that ``desc`` names a live engine this process may attach to; raises ``CrossMemoryError`` if not."""
    if desc.boot_id != own.boot_id:
        raise CrossMemoryError(
            errno.EXDEV,
            f"engine {desc.key!r} runs on another host or boot (boot id {desc.boot_id}, "
            f"here {own.boot_id}): cross-memory attach reaches processes on this host only",
        )
    if desc.pid_namespace != own.pid_namespace:
        raise CrossMemoryError(
            errno.EXDEV,
            f"engine {desc.key!r} runs in another pid namespace (inode {desc.pid_namespace}, "
            f"here {own.pid_namespace}), where pid {desc.pid} names another process: run both "
            "in one pid namespace (containers: --pid=host or a shared pod)",
        )
    try:
        pidfd = os.pidfd_open(desc.pid)
    except ProcessLookupError:
        raise CrossMemoryError(
            errno.ESRCH, f"process {desc.pid} of engine {desc.key!r} is gone"
        ) from None
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
    peer = Peer(desc, pidfd, registry, use_board=desc is not own)
    reason = peer.gone()
    if reason is not None:  # it died while being checked: the pid may already be someone else's
        peer.close()
        raise CrossMemoryError(errno.ESRCH, reason)
    return peer


def _probe(desc: CrossMemoryEngineDesc) -> None:
    """Read the engine's token out of its memory: proves the permission and that the pid is that engine."""
    found = ctypes.create_string_buffer(TOKEN_BYTES)
    try:
        move_ranges(
            SYSCALLS["read"],
            desc.pid,
            "read",
            ctypes.addressof(found),
            desc.token_address,
            [0],
            [0],
            [TOKEN_BYTES],
        )
    except CrossMemoryError as exc:
        raise CrossMemoryError(exc.errno, f"cannot attach to engine {desc.key!r}: {exc}") from None
    if found.raw != desc.token:
        raise CrossMemoryError(
            errno.ESTALE,
            f"process {desc.pid} is not engine {desc.key!r}: its pid now belongs to another process",
        )

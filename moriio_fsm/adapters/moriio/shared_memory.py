"""Anonymous shared-memory regions (memfds) that a peer process on the same host can map.

Rules: no name in /dev/shm, so nothing leaks when the owner dies; a peer opens a region through
``/proc/<owner pid>/fd/<fd>`` while the owner keeps the fd open, and its mapping then stands on its own.
A region is either allocated here or adopted: a tensor's whole pages moved onto a sealed memfd in place.
"""

from __future__ import annotations

from ...errors import MoriioFsmError

import ctypes
import errno
import fcntl
import logging
import mmap
import os
import secrets
import threading
import weakref

import torch

__all__ = ["SharedRegion", "AdoptedPages", "PeerMapping", "PeerPages", "RegionUnavailable", "REGION_NAME_PREFIX",
           "ADOPTED_NAME_PREFIX", "peer_region_problem"]

_log = logging.getLogger(__name__)

# Every region is a memfd named with this prefix: /proc/<pid>/fd links read
# "/memfd:moriio-loopback-<token> (deleted)", and so do its lines in /proc/<pid>/maps.
REGION_NAME_PREFIX = "moriio-loopback-"
# Adopted pages carry their own prefix: they outlive their fd as the tensor's memory.
ADOPTED_NAME_PREFIX = "moriio-pages-"
# A peer that maps a region and copies into it would die of SIGBUS if the owner shrank the
# file under it; an adopted region is sealed against any change of size, and checked for it.
_SIZE_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW


class RegionUnavailable(MoriioFsmError, OSError):
    """A peer's region cannot be opened: the owner is gone or closed it."""


def peer_region_problem(pid: int, fd: int, token: str, prefix: str = REGION_NAME_PREFIX) -> str | None:
    """Why process ``pid`` no longer offers region ``token`` at ``fd``, or None if it does."""
    try:
        target = os.readlink(f"/proc/{pid}/fd/{fd}")
    except OSError as exc:
        if not os.path.isdir(f"/proc/{pid}"):
            return f"peer process {pid} is gone"
        if exc.errno == errno.ENOENT:
            return f"peer process {pid} closed shared region {token}"
        return f"cannot reach shared region {token} of process {pid}: {exc.strerror}"
    # The fd number may have been reused since the descriptor was packed; the
    # memfd name carries the region's token.
    if prefix + token not in target:
        return f"peer process {pid} closed shared region {token} (fd {fd} now holds {target})"
    return None


class SharedRegion:
    """A block of shared memory owned by this process.

    Made by ``allocate``, which also returns the one flat uint8 tensor over the
    whole region. The memory lives while that tensor or any view of it lives;
    when the last one is collected the mapping is unmapped and the fd closed,
    and ``closed`` becomes True. ``close`` closes the fd earlier, which only
    stops new peers from opening the region; memory already mapped (here or by
    peers) stays valid until its last mapping is dropped.
    """

    def __init__(self, fd: int, token: str, size: int, mapping: mmap.mmap, base_address: int) -> None:
        self.size = size
        self.token = token
        self.pid = os.getpid()
        self.base_address = base_address
        self._lock = threading.Lock()
        self._fd: int | None = fd
        # Not a strong reference: the tensors handed out decide how long the memory lives.
        weakref.finalize(mapping, self.close)

    @classmethod
    def allocate(cls, size: int) -> tuple["SharedRegion", torch.Tensor]:
        """A new zeroed region of ``size`` bytes and the flat uint8 tensor over it."""
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"shared region size must be a positive number of bytes, got {size!r}")
        token = secrets.token_hex(8)
        fd = os.memfd_create(REGION_NAME_PREFIX + token, os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
            mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
        except BaseException:
            os.close(fd)
            raise
        tensor = torch.frombuffer(mapping, dtype=torch.uint8)
        return cls(fd, token, size, mapping, tensor.data_ptr()), tensor

    @property
    def fd(self) -> int:
        fd = self._fd
        if fd is None:
            raise RegionUnavailable(f"shared region {self.token} is closed")
        return fd

    @property
    def closed(self) -> bool:
        return self._fd is None

    def contains(self, address: int, nbytes: int) -> bool:
        base = self.base_address
        return base <= address and address + nbytes <= base + self.size

    def close(self) -> None:
        """Close the fd so no new peer can open the region; idempotent."""
        with self._lock:
            fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)


def _open_peer_region(pid: int, fd: int, token: str, size: int, prefix: str) -> int:
    """An fd of our own on process ``pid``'s region ``token`` of at least ``size`` bytes."""
    problem = peer_region_problem(pid, fd, token, prefix)
    if problem is not None:
        raise RegionUnavailable(problem)
    try:
        peer_fd = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR | os.O_CLOEXEC)
    except OSError as exc:
        raise RegionUnavailable(f"cannot open shared region {token} of process {pid}: {exc.strerror}") from None
    try:
        if os.fstat(peer_fd).st_size < size:
            raise RegionUnavailable(f"shared region {token} of process {pid} is smaller than {size} bytes")
    except BaseException:
        os.close(peer_fd)
        raise
    return peer_fd


class PeerMapping:
    """This process's mapping of a region owned by another process (``fd`` is the owner's).

    The mapping lasts while this object or its ``tensor`` (or a view of it) lives.
    """

    def __init__(self, pid: int, fd: int, token: str, size: int) -> None:
        peer_fd = _open_peer_region(pid, fd, token, size, REGION_NAME_PREFIX)
        try:
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            self._map = mmap.mmap(peer_fd, size, flags=flags)
        finally:
            os.close(peer_fd)
        self.pid = pid
        self.fd = fd
        self.token = token
        self.size = size
        self.tensor = torch.frombuffer(self._map, dtype=torch.uint8)


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.mremap.restype = ctypes.c_void_p
_libc.mremap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
_libc.munmap.restype = ctypes.c_int
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value
_MREMAP_MAYMOVE, _MREMAP_FIXED = 1, 2


def _whole_pages(address: int, nbytes: int) -> tuple[int, int]:
    """The first whole page inside [address, address + nbytes) and the bytes of whole pages there."""
    page = mmap.PAGESIZE
    start = -(-address // page) * page
    end = (address + nbytes) // page * page
    return start, max(0, end - start)


def _private_anonymous(start: int, size: int) -> bool:
    """Whether every byte of [start, start + size) is this process's private anonymous memory.

    Only such memory may be moved: pages of a file or of shared memory are someone else's
    too, and moving them would cut that tie.
    """
    end, covered = start + size, start
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            low, high = (int(part, 16) for part in fields[0].split("-"))
            if high <= covered or low >= end:
                continue
            path = fields[5].strip() if len(fields) > 5 else ""
            if low > covered or fields[1] != "rw-p" or path not in ("", "[heap]"):
                return False
            covered = high
            if covered >= end:
                return True
    return False


class AdoptedPages:
    """The whole pages of memory this process allocated, moved onto a sealed memfd in place.

    Same addresses, same bytes: the owner's tensor goes on using them, and a peer on this
    host maps them (``PeerPages``) and copies into them with a plain memory copy, where a
    cross-process copy would pin every 4 KiB page again on each call. ``give_back`` moves
    the bytes back onto private memory, as the allocator handed them out (an allocator may
    reuse freed memory and expect private pages: a page it discards must read as zeros),
    and closes the fd; peers' mappings then hold pages nobody else uses. Nothing may write
    the memory while it is adopted or given back: such a write could be lost. A process
    forked meanwhile shares the pages with its parent, as any shared memory.
    """

    def __init__(self, fd: int, token: str, start: int, size: int) -> None:
        self.token = token
        self.start = start
        self.size = size
        self._lock = threading.Lock()
        self._fd: int | None = fd

    @classmethod
    def adopt(cls, address: int, nbytes: int) -> "AdoptedPages | None":
        """Adopt the whole pages inside [address, address + nbytes); None when there are none,
        when the memory is not private anonymous memory, or when the system refuses (logged)."""
        start, size = _whole_pages(address, nbytes)
        if size == 0 or not _private_anonymous(start, size):
            return None
        token = secrets.token_hex(8)
        fd = os.memfd_create(ADOPTED_NAME_PREFIX + token, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        staging = None
        try:
            os.ftruncate(fd, size)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SIZE_SEALS | fcntl.F_SEAL_SEAL)
            staging = _libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
            if staging in (None, _MAP_FAILED):
                staging = None
                raise OSError(ctypes.get_errno(), "mmap of the new region failed")
            _swap_in(staging, start, size)
        except OSError as exc:
            if staging is not None:
                _libc.munmap(staging, size)
            os.close(fd)
            _log.warning("could not share %d bytes at %#x with peers (%s); they are copied by the kernel instead",
                         size, start, exc.strerror or exc)
            return None
        except BaseException:
            if staging is not None:
                _libc.munmap(staging, size)
            os.close(fd)
            raise
        return cls(fd, token, start, size)

    @property
    def fd(self) -> int:
        fd = self._fd
        if fd is None:
            raise RegionUnavailable(f"adopted pages {self.token} are closed")
        return fd

    def give_back(self) -> bool:
        """Put the bytes back on private memory and close the fd; idempotent. False (logged)
        when the system refuses: the pages then stay shared, and the caller must not let
        the memory be freed."""
        with self._lock:
            fd, self._fd = self._fd, None
        if fd is None:
            return True
        try:
            staging = _libc.mmap(None, self.size, mmap.PROT_READ | mmap.PROT_WRITE,
                                 mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
            if staging in (None, _MAP_FAILED):
                raise OSError(ctypes.get_errno(), "mmap of private memory failed")
            try:
                _swap_in(staging, self.start, self.size)
            except BaseException:
                _libc.munmap(staging, self.size)
                raise
        except OSError as exc:
            _log.warning("could not move %d shared bytes at %#x back onto private memory (%s)",
                         self.size, self.start, exc.strerror or exc)
            return False
        finally:
            os.close(fd)
        return True


def _swap_in(staging: int, start: int, size: int) -> None:
    """Copy [start, +size) into the mapping at ``staging``, then move that mapping over it.

    One call swaps the pages: the moved mapping replaces the old one, so the range is never
    without memory. Raises ``OSError`` if the move is refused (the old pages then stay).
    """
    ctypes.memmove(staging, start, size)
    moved = _libc.mremap(staging, size, size, _MREMAP_MAYMOVE | _MREMAP_FIXED, start)
    if moved != start:
        raise OSError(ctypes.get_errno(), f"mremap onto [{start:#x}, +{size}) failed")


class PeerPages:
    """This process's mapping of another process's ``AdoptedPages``, at ``address``.

    Mapped with every page table entry filled in, and no fd kept (a process may map many
    peers' layers). The region must be sealed against shrinking, so a copy into it can
    never fault. The mapping lasts while this object lives.
    """

    def __init__(self, pid: int, fd: int, token: str, size: int) -> None:
        peer_fd = _open_peer_region(pid, fd, token, size, ADOPTED_NAME_PREFIX)
        try:
            if fcntl.fcntl(peer_fd, fcntl.F_GET_SEALS) & fcntl.F_SEAL_SHRINK == 0:
                raise RegionUnavailable(f"shared region {token} of process {pid} is not sealed against shrinking")
            address = _libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE,
                                 mmap.MAP_SHARED | mmap.MAP_POPULATE, peer_fd, 0)
            if address in (None, _MAP_FAILED):
                err = ctypes.get_errno()
                raise RegionUnavailable(f"cannot map shared region {token} of process {pid}: {os.strerror(err)}")
        finally:
            os.close(peer_fd)
        self.pid, self.token, self.size, self.address = pid, token, size, address
        weakref.finalize(self, _libc.munmap, address, size)

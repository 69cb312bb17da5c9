"""Registered tensors' pages shared with peers on this host: moved in place onto a sealed memfd, and mapped by peers.

Rules: only whole pages of this process's private anonymous memory are adopted, and only when no other registration
covers them; a process-wide ledger counts the registrations over each adopted region, and the last one to go gives
its bytes back to private memory; a peer maps only a sealed shmem memfd that the owner maps where it says, fully backed.
"""

from __future__ import annotations

import ctypes
import fcntl
import logging
import mmap
import os
import resource
import secrets
import threading
import weakref
from dataclasses import dataclass, field

from ..shared_memory import SHMEM_DEVICE as _SHMEM_DEVICE
from ..shared_memory import SIZE_SEALS as _SIZE_SEALS
from ..shared_memory import RegionUnavailable, open_peer_region

__all__ = ["ADOPTED_NAME_PREFIX", "AdoptedPages", "MemoryClaim", "PeerPages", "claim_memory"]

_log = logging.getLogger(__name__)

# Every adopted region is a memfd named with this prefix and a token: its lines in
# /proc/<pid>/maps read "/memfd:moriio-pages-<token> (deleted)".
ADOPTED_NAME_PREFIX = "moriio-pages-"
# Pages move in chunks, so that moving a large cache costs one chunk of extra memory, not a second cache.
_CHUNK = 64 << 20
_PAGE = mmap.PAGESIZE

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
_libc.mremap.restype = ctypes.c_void_p
_libc.mremap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_void_p,
]
_libc.munmap.restype = ctypes.c_int
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.madvise.restype = ctypes.c_int
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.fallocate.restype = ctypes.c_int
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
_MAP_FAILED = ctypes.c_void_p(-1).value
_MREMAP_MAYMOVE, _MREMAP_FIXED = 1, 2
_MADV_DONTFORK = 10
_MAP_FIXED = 0x10  # not in Python's mmap module
_FALLOC_FL_KEEP_SIZE, _FALLOC_FL_PUNCH_HOLE = 1, 2
_RW = mmap.PROT_READ | mmap.PROT_WRITE


def _map(address: int | None, size: int, flags: int, fd: int = -1, offset: int = 0) -> int:
    mapped = _libc.mmap(address, size, _RW, flags, fd, offset)
    if mapped in (None, _MAP_FAILED) or (address is not None and mapped != address):
        raise OSError(ctypes.get_errno(), f"mmap of {size} bytes failed")
    return mapped


def _whole_pages(address: int, nbytes: int) -> tuple[int, int]:
    """The first whole page inside [address, address + nbytes) and the bytes of whole pages there."""
    start = -(-address // _PAGE) * _PAGE
    end = (address + nbytes) // _PAGE * _PAGE
    return start, max(0, end - start)


def _maps_cover(path: str, start: int, size: int, wanted) -> bool:
    """Whether the mappings in ``path`` (a /proc maps file) cover [start, +size), with no gap,
    by lines whose permissions and name ``wanted(perms, name)`` accepts."""
    end, covered = start + size, start
    with open(path) as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            low, high = (int(part, 16) for part in fields[0].split("-"))
            if high <= covered or low >= end:
                continue
            name = fields[5].strip() if len(fields) > 5 else ""
            if low > covered or not wanted(fields[1], name):
                return False
            covered = high
            if covered >= end:
                return True
    return False


def plain_memory(address: int, nbytes: int) -> bool:
    """Whether [address, +nbytes) is all this process's private anonymous memory, read-write
    (pages of a file or of shared memory are someone else's too; a read-only page or a
    truncated file would kill a memory copy that the kernel's copy answers with EFAULT)."""
    start = address // _PAGE * _PAGE
    try:
        return _maps_cover(
            "/proc/self/maps",
            start,
            -(-(address + nbytes) // _PAGE) * _PAGE - start,
            lambda perms, name: perms == "rw-p" and name in ("", "[heap]"),
        )
    except OSError:
        return False


class AdoptedPages:
    """Whole pages of memory this process allocated, moved onto a sealed memfd in place.

    Same addresses, same bytes: the owner's tensor goes on using them, and a peer on this
    host maps them (``PeerPages``) and copies into them with a plain memory copy, where a
    cross-process copy would pin every 4 KiB page again on each call. ``give_back`` moves
    the bytes back onto private memory, as the allocator handed them out (an allocator may
    reuse freed memory and expect private pages: a page it discards must read as zeros),
    frees the memfd's pages (a peer's old mapping then holds none) and closes the fd.
    Nothing may write the memory while it is adopted or given back: such a write could be
    lost. The pages are not inherited by a forked child (MADV_DONTFORK, as RDMA does), so
    a child cannot write into the parent's cache through them. Use through ``claim_memory``.
    """

    def __init__(self, fd: int, token: str, start: int, size: int) -> None:
        self.token = token
        self.start = start
        self.size = size
        self._fd: int | None = fd

    @classmethod
    def adopt(cls, address: int, nbytes: int) -> AdoptedPages | None:
        """Adopt the whole pages inside [address, +nbytes); None when there are none, when the
        memory is not private anonymous memory, or when the system refuses (logged)."""
        start, size = _whole_pages(address, nbytes)
        if size == 0 or not plain_memory(start, size):
            return None
        token = secrets.token_hex(8)
        try:
            fd = os.memfd_create(ADOPTED_NAME_PREFIX + token, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        except OSError as exc:
            _log.warning(
                "could not share %d bytes at %#x with peers (%s); the kernel copies into them instead",
                size,
                start,
                exc.strerror or exc,
            )
            return None
        moved = 0
        try:
            os.ftruncate(fd, size)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SIZE_SEALS)
            while moved < size:
                moved += _move_onto_file(fd, start, moved, min(_CHUNK, size - moved))
            _libc.madvise(start, size, _MADV_DONTFORK)
        except OSError as exc:
            if moved == 0:
                os.close(fd)
                _log.warning(
                    "could not share %d bytes at %#x with peers (%s); the kernel copies into them "
                    "instead",
                    size,
                    start,
                    exc.strerror or exc,
                )
                return None
            # Part of the range is on the memfd already: keep that part adopted.
            _log.warning(
                "shared only %d of %d bytes at %#x with peers (%s)",
                moved,
                size,
                start,
                exc.strerror or exc,
            )
            size = moved
        except BaseException:
            if moved == 0:
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
        """Put the bytes back on private memory, free the memfd's pages, close the fd;
        idempotent. False (logged) when the system refuses part of it: those pages stay
        shared, and the caller must never let the memory be freed."""
        fd, self._fd = self._fd, None
        if fd is None:
            return True
        try:
            if not self._still_mine():
                return True  # the memory was freed or remapped under its registration
            done = 0
            try:
                while done < self.size:
                    done += _move_onto_private(fd, self.start, done, min(_CHUNK, self.size - done))
            except OSError as exc:
                _log.warning(
                    "could not move %d shared bytes at %#x back onto private memory (%s)",
                    self.size - done,
                    self.start + done,
                    exc.strerror or exc,
                )
                return False
            _libc.fallocate(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, 0, self.size)
            return True
        finally:
            os.close(fd)

    def _still_mine(self) -> bool:
        name = ADOPTED_NAME_PREFIX + self.token
        try:
            return _maps_cover(
                "/proc/self/maps", self.start, self.size, lambda perms, line_name: name in line_name
            )
        except OSError:
            return False


def _move_onto_file(fd: int, start: int, offset: int, size: int) -> int:
    """Copy [start + offset, +size) into the memfd, then map the memfd's copy over it."""
    source = (ctypes.c_char * size).from_address(start + offset)
    written = 0
    while written < size:
        written += os.pwrite(fd, memoryview(source)[written:], offset + written)
    try:
        _map(start + offset, size, mmap.MAP_SHARED | _MAP_FIXED, fd, offset)
    except OSError:
        # A MAP_FIXED that fails may already have unmapped the range: the memfd holds its bytes.
        _map(start + offset, size, mmap.MAP_SHARED | _MAP_FIXED, fd, offset)
    return size


def _move_onto_private(fd: int, start: int, offset: int, size: int) -> int:
    """Copy [start + offset, +size) into fresh private memory, then move that memory over it."""
    staging = _map(None, size, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    ctypes.memmove(staging, start + offset, size)
    moved = _libc.mremap(staging, size, size, _MREMAP_MAYMOVE | _MREMAP_FIXED, start + offset)
    if moved != start + offset:
        err = ctypes.get_errno()
        _libc.munmap(staging, size)
        # A move that fails may already have unmapped the range: map the memfd's bytes back.
        _map(start + offset, size, mmap.MAP_SHARED | _MAP_FIXED, fd, offset)
        raise OSError(err, f"mremap onto [{start + offset:#x}, +{size}) failed")
    return size


# -- the ledger: every registration of this process, and who adopted what ------------------


@dataclass(eq=False)
class MemoryClaim:
    """One registration's claim on its memory: the region it adopted, if any, and whether a
    memory copy may use it (``plain``). ``release`` at deregistration."""

    start: int
    end: int
    plain: bool
    adopted: AdoptedPages | None = None
    holding: list[_Region] = field(default_factory=list)
    released: bool = False

    def release(self, give_back: bool = True) -> bool:
        """Let go of the memory; the last claim over an adopted region gives it back (unless
        not ``give_back``: a peer may still be copying into it). False if pages stay shared."""
        return _LEDGER.release(self, give_back)


@dataclass(eq=False)
class _Region:
    pages: AdoptedPages
    claims: int = 1


class _Ledger:
    def __init__(self) -> None:
        self._lock = (
            threading.Lock()
        )  # one adoption at a time: two threads must not adopt the same pages
        self._claims: set[MemoryClaim] = set()
        self._regions: list[_Region] = []

    def claim(self, address: int, nbytes: int, share: bool) -> MemoryClaim:
        end = address + nbytes
        with self._lock:
            claim = MemoryClaim(address, end, plain_memory(address, nbytes))
            overlaps = any(other.start < end and address < other.end for other in self._claims)
            if share and claim.plain and not overlaps and _fds_to_spare():
                claim.adopted = AdoptedPages.adopt(address, nbytes)
                if claim.adopted is not None:
                    region = _Region(claim.adopted)
                    self._regions.append(region)
                    claim.holding.append(region)
            for region in self._regions:
                pages = region.pages
                if (
                    region not in claim.holding
                    and pages.start < end
                    and address < pages.start + pages.size
                ):
                    region.claims += 1  # given back only once this claim is gone too
                    claim.holding.append(region)
            self._claims.add(claim)
            return claim

    def release(self, claim: MemoryClaim, give_back: bool) -> bool:
        with self._lock:
            if claim.released:
                return True
            claim.released = True
            self._claims.discard(claim)
            kept = True
            for region in claim.holding:
                region.claims -= 1
                if region.claims == 0:
                    self._regions.remove(region)
                    kept = region.pages.give_back() if give_back else False
            return kept


_LEDGER = _Ledger()


def _fds_to_spare() -> bool:
    """Whether this process may keep one more fd open for an adopted region: each keeps one,
    and a process short of fds is worse off than one whose copies go by the kernel."""
    try:
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        in_use = len(os.listdir("/proc/self/fd"))
    except OSError:
        return False
    if soft == resource.RLIM_INFINITY or in_use < soft // 2:
        return True
    if not _fd_warning.is_set():
        _fd_warning.set()
        _log.warning(
            "%d of %d fds in use: registered memory is no longer shared with peers (one fd each); "
            "raise the limit (ulimit -n) to share it",
            in_use,
            soft,
        )
    return False


_fd_warning = threading.Event()


def claim_memory(address: int, nbytes: int, share: bool) -> MemoryClaim:
    """Record a registration of [address, +nbytes); with ``share``, adopt its whole pages when
    it is plain memory that no other registration covers."""
    return _LEDGER.claim(address, nbytes, share)


# -- a peer's side -------------------------------------------------------------------------


class PeerPages:
    """This process's mapping of another process's ``AdoptedPages``, at ``address``.

    Refused (``RegionUnavailable``) unless the region is a shmem memfd sealed against any
    change of size, fully backed by the owner's pages (so that mapping it costs the owner's
    memory, not ours) and mapped by the owner at ``owner_start`` (so that a descriptor cannot
    point one registration at another's pages). Mapped with its page table filled in, and
    no fd kept. The mapping lasts while this object lives; the process's exit unmaps it, so
    no finalizer runs at exit under a copy still running on a daemon thread.
    """

    def __init__(self, pid: int, fd: int, token: str, size: int, owner_start: int) -> None:
        name = ADOPTED_NAME_PREFIX + token
        peer_fd = open_peer_region(pid, fd, token, size, ADOPTED_NAME_PREFIX)
        try:
            self._check(peer_fd, pid, name, size, owner_start)
            try:
                address = _map(None, size, mmap.MAP_SHARED | mmap.MAP_POPULATE, peer_fd)
            except OSError as exc:
                raise RegionUnavailable(
                    f"cannot map shared region {token} of process {pid}: {exc.strerror}"
                ) from None
        finally:
            os.close(peer_fd)
        self.pid, self.token, self.size, self.address = pid, token, size, address
        weakref.finalize(self, _libc.munmap, address, size).atexit = False

    @staticmethod
    def _check(peer_fd: int, pid: int, name: str, size: int, owner_start: int) -> None:
        what = f"shared region {name} of process {pid}"
        # The fd was opened by path: check that it is the region the name check saw.
        if name not in os.readlink(f"/proc/self/fd/{peer_fd}"):
            raise RegionUnavailable(f"{what} changed while it was opened")
        facts = os.fstat(peer_fd)
        if _SHMEM_DEVICE is None or facts.st_dev != _SHMEM_DEVICE:
            raise RegionUnavailable(f"{what} is not an ordinary memfd (a huge-page one can fault)")
        try:
            seals = fcntl.fcntl(peer_fd, fcntl.F_GET_SEALS)
        except OSError:
            seals = 0
        if seals & fcntl.F_SEAL_SHRINK == 0:
            raise RegionUnavailable(f"{what} is not sealed against shrinking")
        if facts.st_blocks * 512 < size:
            raise RegionUnavailable(
                f"{what} is not backed by the owner's memory "
                f"({facts.st_blocks * 512} of {size} bytes)"
            )
        try:
            mapped = _maps_cover(
                f"/proc/{pid}/maps",
                owner_start,
                size,
                lambda perms, line_name: name in line_name and perms == "rw-s",
            )
        except OSError:
            mapped = False
        if not mapped:
            raise RegionUnavailable(f"{what} is not mapped at {owner_start:#x} in its owner")

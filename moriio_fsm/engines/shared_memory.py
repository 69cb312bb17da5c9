"""Anonymous shared-memory regions (memfds) that a peer process on the same host can map.

Rules: no name in /dev/shm, so nothing leaks when the owner dies; a peer opens a region through
``/proc/<owner pid>/fd/<fd>`` while the owner keeps the fd open, and its mapping then stands on its own;
a region made ``sealed`` can change size for nobody, and a peer asked to map one refuses any other.
(``shared_pages`` adopts a registered tensor's pages onto such a memfd, with its own name prefix.)
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import secrets
import threading
import weakref

import torch

from ..errors import MoriioFsmError

__all__ = [
    "SharedRegion",
    "PeerMapping",
    "RegionUnavailable",
    "REGION_NAME_PREFIX",
    "SHMEM_DEVICE",
    "SIZE_SEALS",
    "peer_region_problem",
    "open_peer_region",
    "unsealed_problem",
]

# Every region is a memfd named with this prefix: /proc/<pid>/fd links read
# "/memfd:moriio-loopback-<token> (deleted)", and so do its lines in /proc/<pid>/maps.
REGION_NAME_PREFIX = "moriio-loopback-"
# A process touching its mapping of a memfd dies of SIGBUS past the file's end, so a memfd that
# another process may ftruncate is sealed against any change of size (and against unsealing).
SIZE_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


def _shmem_device() -> int | None:
    """The device of this kernel's memfds (a hugetlb memfd lives elsewhere, and can SIGBUS a reader)."""
    try:
        probe = os.memfd_create("moriio-probe", os.MFD_CLOEXEC)
    except OSError:
        return None
    try:
        return os.fstat(probe).st_dev
    finally:
        os.close(probe)


SHMEM_DEVICE = _shmem_device()


def unsealed_problem(fd: int) -> str | None:
    """Why the memfd ``fd`` could still fault a process that maps it, or None: it must be an
    ordinary memfd sealed against any change of size."""
    if SHMEM_DEVICE is None or os.fstat(fd).st_dev != SHMEM_DEVICE:
        return "it is not an ordinary memfd (a huge-page one can fault)"
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        seals = 0
    if seals & SIZE_SEALS != SIZE_SEALS:
        return f"it is not sealed against any change of size (seals {seals:#x}, {SIZE_SEALS:#x} needed)"
    return None


class RegionUnavailable(MoriioFsmError, OSError):
    """A peer's region cannot be opened: the owner is gone or closed it."""


def peer_region_problem(
    pid: int, fd: int, token: str, prefix: str = REGION_NAME_PREFIX
) -> str | None:
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

    def __init__(
        self, fd: int, token: str, size: int, mapping: mmap.mmap, base_address: int
    ) -> None:
        self.size = size
        self.token = token
        self.pid = os.getpid()
        self.base_address = base_address
        self._lock = threading.Lock()
        self._fd: int | None = fd
        # Not a strong reference: the tensors handed out decide how long the memory lives.
        weakref.finalize(mapping, self.close)

    @classmethod
    def allocate(cls, size: int, sealed: bool = False) -> tuple[SharedRegion, torch.Tensor]:
        """A new zeroed region of ``size`` bytes and the flat uint8 tensor over it; ``sealed``:
        nobody can change its size (``SIZE_SEALS``), so no peer can make a mapping of it fault."""
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"shared region size must be a positive number of bytes, got {size!r}")
        token = secrets.token_hex(8)
        fd = os.memfd_create(
            REGION_NAME_PREFIX + token, os.MFD_CLOEXEC | (os.MFD_ALLOW_SEALING if sealed else 0)
        )
        try:
            os.ftruncate(fd, size)
            if sealed:
                fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SIZE_SEALS)
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


def open_peer_region(pid: int, fd: int, token: str, size: int, prefix: str) -> int:
    """An fd of our own on process ``pid``'s region ``token`` of at least ``size`` bytes."""
    problem = peer_region_problem(pid, fd, token, prefix)
    if problem is not None:
        raise RegionUnavailable(problem)
    try:
        peer_fd = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR | os.O_CLOEXEC)
    except OSError as exc:
        raise RegionUnavailable(
            f"cannot open shared region {token} of process {pid}: {exc.strerror}"
        ) from None
    try:
        if os.fstat(peer_fd).st_size < size:
            raise RegionUnavailable(
                f"shared region {token} of process {pid} is smaller than {size} bytes"
            )
    except BaseException:
        os.close(peer_fd)
        raise
    return peer_fd


class PeerMapping:
    """This process's mapping of a region owned by another process (``fd`` is the owner's).

    The mapping lasts while this object or its ``tensor`` (or a view of it) lives. ``sealed``:
    refused (``RegionUnavailable``) unless the region is sealed against any change of size,
    so that neither its owner nor another peer can make this mapping fault.
    """

    def __init__(self, pid: int, fd: int, token: str, size: int, sealed: bool = False) -> None:
        peer_fd = open_peer_region(pid, fd, token, size, REGION_NAME_PREFIX)
        try:
            problem = unsealed_problem(peer_fd) if sealed else None
            if problem is not None:
                raise RegionUnavailable(
                    f"shared region {token} of process {pid} cannot be mapped safely: {problem}"
                )
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            self._map = mmap.mmap(peer_fd, size, flags=flags)
        finally:
            os.close(peer_fd)
        self.pid = pid
        self.fd = fd
        self.token = token
        self.size = size
        self.tensor = torch.frombuffer(self._map, dtype=torch.uint8)

"""Anonymous shared-memory regions (memfds) that a peer process on the same host can map.

Rules: no name in /dev/shm, so nothing leaks when the owner dies; a peer opens a region through
``/proc/<owner pid>/fd/<fd>`` while the owner keeps the fd open, and its mapping then stands on its own.
(``shared_pages`` adopts a registered tensor's pages onto such a memfd, with its own name prefix.)
"""

from __future__ import annotations

from ...errors import MoriioFsmError

import errno
import mmap
import os
import secrets
import threading
import weakref

import torch

__all__ = ["SharedRegion", "PeerMapping", "RegionUnavailable", "REGION_NAME_PREFIX", "peer_region_problem",
           "open_peer_region"]

# Every region is a memfd named with this prefix: /proc/<pid>/fd links read
# "/memfd:moriio-loopback-<token> (deleted)", and so do its lines in /proc/<pid>/maps.
REGION_NAME_PREFIX = "moriio-loopback-"


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


def open_peer_region(pid: int, fd: int, token: str, size: int, prefix: str) -> int:
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
        peer_fd = open_peer_region(pid, fd, token, size, REGION_NAME_PREFIX)
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


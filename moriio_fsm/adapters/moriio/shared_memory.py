"""Anonymous shared-memory regions that a peer process on the same host can map.

A region is a memfd: it has no name in /dev/shm, so nothing leaks when its owner
dies. A peer opens it through ``/proc/<owner pid>/fd/<fd>`` for as long as the
owner keeps the fd open; the peer's mapping then stays valid on its own.
"""

from __future__ import annotations

import mmap
import os
import secrets
import threading

import torch

__all__ = ["SharedRegion", "PeerMapping", "process_is_alive", "RegionUnavailable", "REGION_NAME_PREFIX"]

# Every region is a memfd named with this prefix: /proc/<pid>/fd links read
# "/memfd:moriio-loopback-<token> (deleted)", and so do its lines in /proc/<pid>/maps.
REGION_NAME_PREFIX = "moriio-loopback-"


class RegionUnavailable(OSError):
    """A peer's region cannot be opened: the owner is gone or closed it."""


def process_is_alive(pid: int) -> bool:
    """True while ``pid`` runs; a zombie (exited, not yet reaped) counts as gone."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            # The state letter follows the parenthesised command name.
            state = stat.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in (b"Z", b"X")


class SharedRegion:
    """A block of shared memory owned by this process.

    ``tensor`` is a flat uint8 view of the whole region. ``close`` stops new
    peers from opening it; memory already mapped (here or by peers) stays valid
    until the last mapping is dropped.
    """

    def __init__(self, size: int) -> None:
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"shared region size must be a positive number of bytes, got {size!r}")
        self.size = size
        self.token = secrets.token_hex(8)
        self.pid = os.getpid()
        self._lock = threading.Lock()
        self._fd: int | None = os.memfd_create(REGION_NAME_PREFIX + self.token, os.MFD_CLOEXEC)
        try:
            os.ftruncate(self._fd, size)
            self._map = mmap.mmap(self._fd, size, flags=mmap.MAP_SHARED)
        except BaseException:
            os.close(self._fd)
            raise
        self.tensor = torch.frombuffer(self._map, dtype=torch.uint8)

    @property
    def fd(self) -> int:
        if self._fd is None:
            raise RegionUnavailable(f"shared region {self.token} is closed")
        return self._fd

    @property
    def closed(self) -> bool:
        return self._fd is None

    def contains(self, address: int, nbytes: int) -> bool:
        base = self.tensor.data_ptr()
        return base <= address and address + nbytes <= base + self.size

    def close(self) -> None:
        """Close the fd so no new peer can open the region; idempotent."""
        with self._lock:
            fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)


class PeerMapping:
    """This process's mapping of a region owned by another process."""

    def __init__(self, pid: int, fd: int, token: str, size: int) -> None:
        path = f"/proc/{pid}/fd/{fd}"
        try:
            # The fd number may have been reused for something else since the
            # descriptor was packed; the memfd name carries the region's token.
            target = os.readlink(path)
        except OSError as exc:
            raise RegionUnavailable(
                f"cannot open shared region {token} of process {pid}: {exc.strerror}"
            ) from None
        if REGION_NAME_PREFIX + token not in target:
            raise RegionUnavailable(
                f"process {pid} no longer holds shared region {token} at fd {fd}"
            )
        try:
            peer_fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except OSError as exc:
            raise RegionUnavailable(
                f"cannot open shared region {token} of process {pid}: {exc.strerror}"
            ) from None
        try:
            if os.fstat(peer_fd).st_size < size:
                raise RegionUnavailable(
                    f"shared region {token} of process {pid} is smaller than {size} bytes"
                )
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            self._map = mmap.mmap(peer_fd, size, flags=flags)
        finally:
            os.close(peer_fd)
        self.pid = pid
        self.token = token
        self.size = size
        self.tensor = torch.frombuffer(self._map, dtype=torch.uint8)

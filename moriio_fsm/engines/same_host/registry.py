"""The registration table a cross-memory engine publishes to same-host peers, so deregistered memory is never touched.

Rules: a memfd holds a random token and one entry per slot (the registration's mem_id, address and size; zeros when
free); a transfer runs only while it holds a shared OFD lock on the slots it uses and sees its entries there, and
withdrawing a slot clears it first, then takes its exclusive lock, which waits for the transfers in flight.
"""

from __future__ import annotations

import errno
import fcntl
import os
import secrets
import struct
import threading
import time

from ...errors import MoriioFsmError

__all__ = ["PublishedRegistry", "RegistryView", "RegistryUnavailable", "REGISTRY_NAME_PREFIX"]

REGISTRY_NAME_PREFIX = "moriio-cma-registry-"
TOKEN_BYTES = 16
_ENTRY = struct.Struct("<QQQ")  # mem_id, address, size
_SLOT_BYTES = _ENTRY.size
# struct flock on 64-bit Linux: l_type, l_whence, l_start, l_len, l_pid (+ padding); l_pid is 0 for OFD locks.
_FLOCK = struct.Struct("hhqqi4x")
_BUSY = (errno.EAGAIN, errno.EACCES)


class RegistryUnavailable(MoriioFsmError, OSError):
    """A peer's registration table cannot be opened: the peer is gone, closed it, or is not who it says."""

    errno: int  # always given


def _slot_offset(slot: int) -> int:
    return TOKEN_BYTES + slot * _SLOT_BYTES


def _lock(fd: int, kind: int, start: int, length: int, *, wait: bool = False) -> bool:
    """Take (or, with F_UNLCK, drop) an OFD lock; False when another holder is in the way.

    OFD locks belong to the open file description, not the process, so two engines in
    one process (each with its own open of the table) exclude each other as two
    processes would, and a process that dies drops its locks with its descriptors.
    """
    command = fcntl.F_OFD_SETLKW if wait else fcntl.F_OFD_SETLK
    try:
        fcntl.fcntl(fd, command, _FLOCK.pack(kind, os.SEEK_SET, start, length, 0))
    except OSError as exc:
        if exc.errno in _BUSY:
            return False
        raise
    return True


class PublishedRegistry:
    """This engine's table: one slot per registered tensor, readable by every peer that opens it."""

    def __init__(self, capacity: int) -> None:
        self.token = secrets.token_bytes(TOKEN_BYTES)
        self.capacity = capacity
        self._lock = threading.Lock()
        self._free = list(range(capacity - 1, -1, -1))
        self.fd = os.memfd_create(REGISTRY_NAME_PREFIX + self.token.hex(), os.MFD_CLOEXEC)
        try:
            os.ftruncate(
                self.fd, _slot_offset(capacity)
            )  # sparse: pages appear when slots are used
            os.pwrite(self.fd, self.token, 0)
        except BaseException:
            os.close(self.fd)
            raise

    def publish(self, mem_id: int, address: int, size: int) -> int:
        """Enter one registration (``mem_id`` > 0) in a free slot; returns the slot."""
        with self._lock:
            if not self._free:
                raise RuntimeError(
                    f"registration table full: {self.capacity} tensors are registered; "
                    "deregister some first"
                )
            slot = self._free.pop()
        os.pwrite(self.fd, _ENTRY.pack(mem_id, address, size), _slot_offset(slot))
        return slot

    def withdraw(self, slot: int, wait_s: float) -> bool:
        """Clear ``slot`` so no new transfer uses it, then wait for those in flight.

        True when none holds it any more (the slot is free again); False when one still
        did after ``wait_s`` seconds, and the slot stays out of use.
        """
        os.pwrite(self.fd, bytes(_SLOT_BYTES), _slot_offset(slot))
        if not self._wait_exclusive(_slot_offset(slot), _SLOT_BYTES, wait_s):
            return False
        _lock(self.fd, fcntl.F_UNLCK, _slot_offset(slot), _SLOT_BYTES)
        with self._lock:
            self._free.append(slot)
        return True

    def close(self, wait_s: float) -> bool:
        """Withdraw every slot at once and close the table; True when no transfer held one any more.

        Peers keep their open table; they read the truncated slots as withdrawn.
        """
        os.ftruncate(self.fd, TOKEN_BYTES)
        quiet = self._wait_exclusive(TOKEN_BYTES, 0, wait_s)  # length 0: every slot
        os.close(self.fd)
        return quiet

    def _wait_exclusive(self, start: int, length: int, wait_s: float) -> bool:
        # Polled rather than F_OFD_SETLKW: a peer stopped mid-transfer (SIGSTOP) must not
        # hang this engine's deregistration or close forever.
        deadline = time.monotonic() + wait_s
        pause = 0.0001
        while not _lock(self.fd, fcntl.F_WRLCK, start, length):
            if time.monotonic() >= deadline:
                return False
            time.sleep(pause)
            pause = min(pause * 2, 0.01)
        return True


class RegistryView:
    """One open of a (possibly another process's) table; its locks are its own.

    Holds are counted per slot: an OFD lock is one lock per open, so without a count the
    first of two overlapping copies to finish (two threads, or two batches of one call)
    would unlock the slot under the other, and its owner could free the memory mid-copy.
    """

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._closed = False
        self._holders: dict[int, int] = {}  # slot -> holds taken and not yet released
        self._holders_lock = threading.Lock()

    @classmethod
    def open(cls, pid: int, table_fd: int, token: bytes) -> RegistryView:
        """Open process ``pid``'s table ``table_fd`` and check it is the one ``token`` names.

        Raises ``RegistryUnavailable`` saying why it cannot be used.
        """
        path = f"/proc/{pid}/fd/{table_fd}"
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except OSError as exc:
            raise RegistryUnavailable(
                exc.errno,
                f"cannot open the registration table of process {pid} ({path}): {exc.strerror}",
            ) from None
        view = cls(fd)
        # The fd number may have been reused since the descriptor was packed: the token tells.
        if os.pread(fd, TOKEN_BYTES, 0) != token:
            view.close()
            raise RegistryUnavailable(
                errno.ESTALE,
                f"fd {table_fd} of process {pid} is not the registration table its "
                "descriptor names (the engine closed it, or the pid now belongs to another process)",
            )
        return view

    def holds(self, slot: int, mem_id: int, address: int, size: int) -> bool:
        """Whether ``slot`` still holds this registration (a snapshot; ``hold`` makes it stick).

        Address and size are compared too, so a descriptor altered on the way can only
        reach memory its owner registered.
        """
        if self._closed:
            return False
        raw = os.pread(self._fd, _SLOT_BYTES, _slot_offset(slot))
        return len(raw) == _SLOT_BYTES and _ENTRY.unpack(raw) == (mem_id, address, size)

    def hold(self, slot: int, mem_id: int, address: int, size: int) -> bool:
        """Keep ``slot`` from being withdrawn until ``release``; False (nothing held) when it is gone.

        Never blocks: a slot being withdrawn counts as gone.
        """
        with self._holders_lock:
            if self._closed:
                return False
            count = self._holders.get(slot, 0)
            if count == 0 and not _lock(self._fd, fcntl.F_RDLCK, _slot_offset(slot), _SLOT_BYTES):
                return False
            if not self.holds(slot, mem_id, address, size):
                if count == 0:  # only a lock this call took is given back
                    _lock(self._fd, fcntl.F_UNLCK, _slot_offset(slot), _SLOT_BYTES)
                return False
            self._holders[slot] = count + 1
            return True

    def release(self, slot: int) -> None:
        """Give back one ``hold``; the lock goes with the last one."""
        with self._holders_lock:
            count = self._holders.pop(slot, 0)
            if count > 1:
                self._holders[slot] = count - 1
            elif count == 1 and not self._closed:
                _lock(self._fd, fcntl.F_UNLCK, _slot_offset(slot), _SLOT_BYTES)

    def close(self) -> None:
        with self._holders_lock:
            if not self._closed:
                self._closed = True
                self._holders.clear()
                os.close(self._fd)

"""Keeping registered memory resident (mlock), as an RDMA registration pins it, so a copy never waits for page faults.

Rules: pinning is asked for, never a condition of registering: a refusal (a memlock limit) is said once in a warning
naming the limit and what raises it, and the memory is used unpinned; only whole pages are locked and unlocked.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import resource
import sys
import threading

__all__ = ["pin_pages", "unpin_pages"]

_log = logging.getLogger(__name__)
_PAGE = mmap.PAGESIZE
_warned = threading.Event()

_libc = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
_mlock = getattr(_libc, "mlock", None)
_munlock = getattr(_libc, "munlock", None)
for _function in (_mlock, _munlock):
    if _function is not None:
        _function.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        _function.restype = ctypes.c_int


def _pages(address: int, nbytes: int) -> tuple[int, int]:
    start = address // _PAGE * _PAGE
    return start, -(-(address + nbytes) // _PAGE) * _PAGE - start


def pin_pages(address: int, nbytes: int, what: str) -> bool:
    """Lock the pages of [address, address + nbytes) in memory; False (and one warning per process) if refused.

    A KV cache's free blocks sit untouched for long stretches, and a kernel may take such
    pages back (reclaim, zero-page shrinking, a VM balloon); a copy into a block then pays
    a fault per 4 KiB page (docs/architecture.md has what that cost).
    """
    if _mlock is None:
        return False
    start, length = _pages(address, nbytes)
    if _mlock(start, length) == 0:
        return True
    err = ctypes.get_errno()
    if not _warned.is_set():
        _warned.set()
        soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
        limit = "unlimited" if soft == resource.RLIM_INFINITY else f"{soft} bytes"
        _log.warning(
            "%s: could not lock %d bytes in memory (%s: %s); RLIMIT_MEMLOCK is %s. Copies into it may wait "
            "for page faults. Raise the limit (ulimit -l unlimited, systemd LimitMEMLOCK=infinity, docker "
            "--ulimit memlock=-1) or give the process CAP_IPC_LOCK, as RDMA deployments do.",
            what,
            length,
            errno.errorcode.get(err, err),
            os.strerror(err),
            limit,
        )
    return False


def unpin_pages(address: int, nbytes: int) -> None:
    """Undo ``pin_pages`` for the same range."""
    if _munlock is not None:
        start, length = _pages(address, nbytes)
        _munlock(start, length)

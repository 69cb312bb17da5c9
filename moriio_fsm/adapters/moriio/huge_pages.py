"""Advising registered memory onto transparent huge pages, so that cross-memory copies pin 2 MiB pages, not 4 KiB ones.

Rules: advice only, never a condition of registering; only whole 2 MiB pages inside the region are advised, so memory
next to it (an allocator's bookkeeping) is left alone; contents never change; every refusal is said in the answer.
"""

from __future__ import annotations

import ctypes
import errno
import os
import sys

__all__ = ["HUGE_PAGE_BYTES", "advise_huge_pages"]

HUGE_PAGE_BYTES = 2 << 20
_MADV_HUGEPAGE = 14     # let the kernel back the range with huge pages from now on
_MADV_COLLAPSE = 25     # Linux 6.1+: turn what is already there into huge pages now

_madvise = None
if sys.platform.startswith("linux"):
    _libc = ctypes.CDLL(None, use_errno=True)
    _madvise = getattr(_libc, "madvise", None)
    if _madvise is not None:
        _madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _madvise.restype = ctypes.c_int


def advise_huge_pages(address: int, nbytes: int, *, collapse: bool = True) -> str:
    """Advise the whole huge pages within [address, address + nbytes); what happened, in words.

    ``collapse`` also asks the kernel to merge the pages already faulted in (a KV cache is
    zero-filled, hence all faulted in, when it is registered); a kernel without
    MADV_COLLAPSE still honours the first advice for pages it faults in later.
    """
    if _madvise is None:
        return "not advised: no madvise on this platform"
    start = -(-address // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    end = (address + nbytes) // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
    if end <= start:
        return "not advised: the region holds no whole 2 MiB page"
    length = end - start
    if _madvise(start, length, _MADV_HUGEPAGE) != 0:
        err = ctypes.get_errno()
        return f"not advised: madvise(MADV_HUGEPAGE) failed ({errno.errorcode.get(err, err)}: {os.strerror(err)})"
    if not collapse:
        return f"{length >> 20} MiB advised"
    if _madvise(start, length, _MADV_COLLAPSE) != 0:
        err = ctypes.get_errno()
        return (f"{length >> 20} MiB advised; not collapsed now "
                f"({errno.errorcode.get(err, err)}: {os.strerror(err)})")
    return f"{length >> 20} MiB advised and collapsed"

"""Copies of ranges between two blocks of this process's memory (a peer's pages mapped here).

Uses the native streaming-store copier when it was built (a transfer's destination is never
read again on this core, so ordinary stores waste a read of every line and this core's
cache), else ``ctypes.memmove`` per range. Both let go of the GIL while bytes move; the caller
has checked every range against its registrations.
"""

from __future__ import annotations

import ctypes
import operator
from collections.abc import Sequence

try:
    import moriio_fsm.engines.same_host._stream_copy as _stream_copy
except ImportError:  # built without a C compiler: the install keeps going without it
    _stream_copy = None


def copier() -> str:
    """What copies here: "streaming stores (avx2)", "streaming stores (sse2)" or "memmove"."""
    if _stream_copy is None or _stream_copy.streaming() is None:
        return "memmove"
    return f"streaming stores ({_stream_copy.streaming()})"


def memmove_ranges(
    dst_base: int,
    dst_offsets: Sequence[int],
    src_base: int,
    src_offsets: Sequence[int],
    sizes: Sequence[int],
) -> None:
    """One ``ctypes.memmove`` per range: the copier without the native module.

    Like the native one, it refuses an ill-typed list or lists of different lengths before
    the first byte moves."""
    dst_offsets, src_offsets, sizes = (
        list(map(operator.index, values)) for values in (dst_offsets, src_offsets, sizes)
    )
    if not len(dst_offsets) == len(src_offsets) == len(sizes):
        raise ValueError(
            f"copy_ranges: dst_offsets, src_offsets and sizes differ in length "
            f"({len(dst_offsets)}, {len(src_offsets)}, {len(sizes)})"
        )
    if any(value < 0 for values in (dst_offsets, src_offsets, sizes) for value in values):
        raise ValueError("copy_ranges: offsets and sizes must be >= 0")
    move = ctypes.memmove
    for dst, src, size in zip(dst_offsets, src_offsets, sizes):
        move(dst_base + dst, src_base + src, size)


#: copy_ranges(dst_base, dst_offsets, src_base, src_offsets, sizes): sizes[k] bytes from
#: src_base + src_offsets[k] to dst_base + dst_offsets[k], for every k.
copy_ranges = _stream_copy.copy_ranges if _stream_copy is not None else memmove_ranges

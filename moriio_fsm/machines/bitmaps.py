"""Layer sets as integer bitmaps, the one representation every machine's context uses.

A bitmap is cheap to copy, compare and count, which keeps records small and steps
atomic; this module only turns one back into layer indices for an effect's payload.
"""

from __future__ import annotations


def layer_indices(bitmap: int) -> tuple[int, ...]:
    """The set bits of ``bitmap`` as ascending layer indices."""
    out = []
    while bitmap:
        low = bitmap & -bitmap
        out.append(low.bit_length() - 1)
        bitmap ^= low
    return tuple(out)

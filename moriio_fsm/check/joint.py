"""The state of a pair run (``pair.py``): both sides' table keys, the channel between them,
the engine's operations, both sides' blocks, the READ handshake and D's start.

Rules: a ``Joint`` is worked on, then frozen into the hashable tuple the search keeps;
freezing forgets what can no longer matter (the context of a side that ended, the
messages to it), so that states differing only in it are one. Layers are bits of an
int; blocks are where the block ledger (``moriio_fsm.ledger``) says they are.
"""

from __future__ import annotations

import math
from typing import Any

from .stepper import _freeze, _thaw

# D's creation in READ mode: not yet possible, possible (P held its blocks), done.
NOT_STARTABLE, STARTABLE, STARTED = 0, 1, 2
#: When a late message is due: never (it may arrive at any time, or not at all).
LATE = math.inf


class Joint:
    """A pair state being worked on (``freeze`` makes the hashable form). Side 0 is P,
    side 1 is D; a channel message is ``(due, to, kind, frozen data)``."""

    __slots__ = (
        "finals",
        "now",
        "p",
        "d",
        "channel",
        "in_flight",
        "teardown",
        "p_blocks",
        "d_blocks",
        "handshake",
        "d_start",
    )

    def __init__(self, finals: tuple, state: tuple):
        self.finals = finals
        (
            self.now,
            self.p,
            self.d,
            channel,
            self.in_flight,
            self.teardown,
            self.p_blocks,
            self.d_blocks,
            self.handshake,
            self.d_start,
        ) = state
        self.channel = list(channel)

    def freeze(self) -> tuple:
        p, d, channel = self.p, self.d, self.channel
        p_ended = p is not None and p[0] in self.finals[0]
        d_ended = d is not None and d[0] in self.finals[1]
        if p_ended:
            p = (p[0], ())
        if d_ended:
            d = (d[0], ())
        if p_ended or d_ended:
            channel = [
                m
                for m in channel
                if not (p_ended and m[1] == "P") and not (d_ended and m[1] == "D")
            ]
        return (
            self.now,
            p,
            d,
            tuple(sorted(channel)),
            self.in_flight,
            self.teardown,
            self.p_blocks,
            self.d_blocks,
            self.handshake,
            self.d_start,
        )

    def copy(self) -> Joint:
        other = Joint.__new__(Joint)
        other.finals = self.finals
        (
            other.now,
            other.p,
            other.d,
            other.in_flight,
            other.teardown,
            other.p_blocks,
            other.d_blocks,
            other.handshake,
            other.d_start,
        ) = (
            self.now,
            self.p,
            self.d,
            self.in_flight,
            self.teardown,
            self.p_blocks,
            self.d_blocks,
            self.handshake,
            self.d_start,
        )
        other.channel = list(self.channel)
        return other

    def key(self, side: int):
        """``side``'s table key (state, deadlines, context), None before it was created."""
        return self.p if side == 0 else self.d

    def set_key(self, side: int, key) -> None:
        if side == 0:
            self.p = key
        else:
            self.d = key

    def blocks(self, side: int) -> int:
        return self.p_blocks if side == 0 else self.d_blocks

    def set_blocks(self, side: int, custody: int) -> None:
        if side == 0:
            self.p_blocks = custody
        else:
            self.d_blocks = custody

    def send(self, to: str, kind: str, **data: Any) -> None:
        """A message to ``to`` ("P" or "D"), sent now."""
        self.channel.append((self.now, to, kind, tuple((n, _freeze(v)) for n, v in data.items())))


def layer_bits(layers) -> int:
    found = 0
    for layer in layers:
        if 0 <= layer < 64:
            found |= 1 << layer
    return found


def show_bits(bitmap: int) -> str:
    return ", ".join(str(i) for i in range(bitmap.bit_length()) if bitmap >> i & 1)


def show_message(message) -> str:
    _, to, kind, data = message
    args = ", ".join(f"{n}={_thaw(v)!r}" for n, v in data)
    return f"message {kind}({args}) to {to}"

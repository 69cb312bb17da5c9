"""Events that enter the runtime and effects that leave it.

Adapters (vLLM hooks, ZMQ listener, RDMA completion poller, timers) build an
``Event``; the core answers with ``Effect`` values that adapters execute. Both
are immutable plain data so that a trace of them can be replayed exactly.
"""

from __future__ import annotations

import enum
from types import MappingProxyType
from typing import Any, Mapping

import msgspec

_EMPTY: Mapping[str, Any] = MappingProxyType({})


# msgspec Structs rather than dataclasses or NamedTuples: one event is built per layer
# per transfer on the hot path, and a frozen Struct is built in C (about a third of a
# NamedTuple's cost here) while staying immutable, hashable and comparable.
class Event(msgspec.Struct, frozen=True, gc=False):
    """One fact about one transfer.

    ``kind`` is an event name declared by the transfer's spec; ``time`` is the
    caller's monotonic clock reading in seconds (the core reads no clock);
    ``data`` carries the payload fields the spec declares for ``kind``; ``source``
    names the peer a remote event came from (its host and connection), so that the
    table can keep one flooding peer from crowding out the others ("" when local).
    """

    transfer_id: str
    kind: str
    time: float = 0.0
    data: Mapping[str, Any] = _EMPTY
    source: str = ""


class Effect(msgspec.Struct, frozen=True, gc=False):
    """Something the outside world must do because of a transition.

    ``kind`` names the effect (``post_writes``, ``send_write_done``,
    ``free_blocks`` ...); ``data`` holds what the adapter needs to carry it out.
    """

    transfer_id: str
    kind: str
    data: Mapping[str, Any] = _EMPTY


class Outcome(enum.Enum):
    """What ``TransferTable.dispatch`` did with an event; every value is counted."""

    CREATED = "created"        # a new transfer was started by a local event
    APPLIED = "applied"        # a transition fired (state change or internal)
    DUPLICATE = "duplicate"    # a repeat of a fact already applied; no change
    IGNORED = "ignored"        # the spec declares the event harmless in this state
    REJECTED = "rejected"      # the spec has no transition for it in this state
    LATE = "late"              # the transfer already ended; nothing can revive it
    UNKNOWN = "unknown"        # a local or timer event for a transfer never created
    BUFFERED = "buffered"      # a remote fact for a transfer not created yet
    DROPPED = "dropped"        # a remote fact for an unknown transfer, buffer full


# A plain int per member lets hot paths count outcomes in a list instead of hashing
# enum members (Enum.__hash__ runs in Python).
for _index, _member in enumerate(Outcome):
    _member.index = _index
del _index, _member

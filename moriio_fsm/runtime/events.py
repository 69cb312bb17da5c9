"""Events that enter the runtime, effects that leave it, and what one dispatch did.

Adapters (vLLM hooks, ZMQ listener, RDMA completion poller, timers) build an
``Event``; the core answers with a ``Result``: an ``Outcome``, the transfer's state and
the ``Effect`` values that adapters execute. All are immutable plain data so that a
trace of them can be replayed exactly.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Any, ClassVar

import msgspec


class _EventHead(msgspec.Struct, frozen=True, gc=False):
    transfer_id: str
    time: float


# msgspec Structs rather than dataclasses or NamedTuples: one event is built per layer
# per transfer on the hot path, and a frozen Struct is built in C (about a third of a
# NamedTuple's cost here) while staying immutable, comparable and cheap to serialize.
class Event(_EventHead, kw_only=True, frozen=True, gc=False):
    """One fact about one transfer.

    Every kind a spec declares under ``events`` is a subclass of this one, made by
    ``moriio_fsm.runtime.declared``: ``transfer_id``, ``time``, then the declared payload
    fields in order, and ``source`` by keyword only
    (``events.layer_scheduled("tx-1", now, layer=3)``); ``kind`` is the declared name.
    ``time`` is the caller's monotonic clock reading in seconds (the core reads no
    clock); ``source`` names the peer a remote event came from (its host, its CURVE key
    when it has one, and its connection: ``sender#connection``), so that the table can
    keep one flooding peer from crowding out the others and take a transfer's facts only
    from its own peer. On a creating event ``source`` binds the new transfer instead:
    ``""`` to no one (any peer may speak for it), ``"?"`` to the first peer it hears from,
    or a comma-separated list of the senders it accepts (see ``TransferTable``). A plain
    ``Event`` has no kind and is rejected by every table.
    """

    source: str = ""
    kind: ClassVar[str] = ""

    @property
    def data(self) -> dict[str, Any]:
        """The payload fields (all but ``transfer_id``, ``time`` and ``source``)."""
        return {name: getattr(self, name) for name in self.__struct_fields__[2:-1]}


class Effect(msgspec.Struct, frozen=True, gc=False):
    """Something the outside world must do because of a transition.

    Every kind a spec declares under ``emits`` is a subclass of this one, made by
    ``moriio_fsm.runtime.declared`` with the declared fields after ``transfer_id``
    (``PostWrite(transfer_id, layer, block_ids, decode_rank)``); ``kind`` is the declared
    name. Effects are immutable, compare by value and are built in C, one per posted
    layer on the hot path.
    """

    transfer_id: str
    kind: ClassVar[str] = ""

    @property
    def data(self) -> dict[str, Any]:
        """The declared fields (everything but ``transfer_id``) as a plain dict."""
        return {name: getattr(self, name) for name in self.__struct_fields__[1:]}


class Outcome(enum.Enum):
    """What ``TransferTable.dispatch`` did with an event; every value is counted."""

    CREATED = "created"  # a new transfer was started by a local event
    APPLIED = "applied"  # a transition fired (state change or internal)
    DUPLICATE = "duplicate"  # a repeat of a fact already applied; no change
    IGNORED = "ignored"  # the spec declares the event harmless in this state
    REJECTED = "rejected"  # the spec has no transition for it in this state
    LATE = "late"  # the transfer already ended; nothing can revive it
    UNKNOWN = "unknown"  # a local or timer event for a transfer never created
    BUFFERED = "buffered"  # a remote fact for a transfer not created yet
    DROPPED = "dropped"  # a remote fact for an unknown transfer, buffer full
    FORGED = "forged"  # a remote fact from a peer the transfer is not bound to

    # Set on each member below; an annotation without a value is not a member.
    index: int


# A plain int per member lets hot paths count outcomes in a list instead of hashing
# enum members (Enum.__hash__ runs in Python).
for _index, _member in enumerate(Outcome):
    _member.index = _index
del _index, _member


class Result(msgspec.Struct, frozen=True, gc=False):
    """What one dispatch did: the outcome, the transfer's state after it, the effects.

    ``state`` is None when no transfer exists for the event (unknown, buffered,
    dropped, rejected before creation). ``hops`` lists the ``(from, to)`` state
    changes in order, eventless follow-ups included, or is None when the state did not
    change. Fields are read by name: a result does not unpack (four fields read as three
    would hide which one was left out).
    """

    outcome: Outcome
    state: str | None
    effects: Sequence[Effect]
    hops: tuple[tuple[str, str], ...] | None = None

"""Turns decoded notify messages into the machines' runtime events.

Rules: the only module of the zmq adapter that knows runtime event names; the wire
codec stays free of them. Each event carries the message's fields and its ``source``;
a field absent on the wire becomes the default its spec declares, written out here.
"""

from __future__ import annotations

from collections.abc import Callable

from moriio_fsm.runtime.declared import events
from moriio_fsm.runtime.events import Event

from .messages import (
    Heartbeat,
    LeaseGranted,
    NotifyMessage,
    Release,
    RemoteBlocks,
    WriteDone,
    WriteFailed,
)

__all__ = ["event_for"]

# An unknown rank is -1 in every spec. It is tested with ``is None``, never ``or``:
# rank 0 is a real rank and must not become "unknown".
_UNKNOWN_RANK = -1


def _rank(value: int | None) -> int:
    return _UNKNOWN_RANK if value is None else value


def _remote_blocks(message: RemoteBlocks, now: float, source: str) -> Event:
    return events.remote_blocks(
        message.transfer_id,
        now,
        message.block_ids,
        message.decode_rank,
        message.req_id,
        message.prompt_digest or "",
        _rank(message.decode_dp_rank),
        source=source,
    )


def _write_done(message: WriteDone, now: float, source: str) -> Event:
    # Absent on the wire means the one writer upstream assumes.
    writers = 1 if message.num_writers is None else message.num_writers
    return events.write_done(
        message.transfer_id, now, writers, _rank(message.producer_rank), source=source
    )


def _write_failed(message: WriteFailed, now: float, source: str) -> Event:
    # Absent writes_stopped means True: a P that does not send the field sent
    # write_failed only once no write of its could still land (this project's P before
    # the field existed; upstream's P only on a defer timeout, before any write was posted).
    stopped = True if message.writes_stopped is None else message.writes_stopped
    return events.write_failed(
        message.transfer_id,
        now,
        message.reason or "",
        stopped,
        _rank(message.producer_rank),
        source=source,
    )


def _release(message: Release, now: float, source: str) -> Event:
    # Absent on the wire means one D rank releases.
    size = 1 if message.consumer_tp_size is None else message.consumer_tp_size
    # The typed form names the rank in consumer_rank, the bare "<id>:tp<rank>" form in its suffix.
    rank = message.consumer_rank if message.consumer_rank is not None else message.sender_tp_rank
    return events.release(message.transfer_id, now, size, _rank(rank), source=source)


def _heartbeat(message: Heartbeat, now: float, source: str) -> Event:
    return events.heartbeat(
        message.transfer_id, now, _rank(message.consumer_rank), message.seq, source=source
    )


def _lease_granted(message: LeaseGranted, now: float, source: str) -> Event:
    return events.lease_granted(
        message.transfer_id,
        now,
        message.seq,
        message.lease_s,
        _rank(message.consumer_rank),
        source=source,
    )


_BUILDERS: dict[type, Callable[..., Event]] = {
    RemoteBlocks: _remote_blocks,
    WriteDone: _write_done,
    WriteFailed: _write_failed,
    Release: _release,
    Heartbeat: _heartbeat,
    LeaseGranted: _lease_granted,
}


def event_for(message: NotifyMessage, now: float, source: str = "") -> Event:
    """The runtime event ``message`` stands for, received at ``now`` from ``source``.

    ``source`` names the sending peer (``Delivery.source``); "" when unknown. Raises
    ``TypeError`` for anything but a decoded notify message.
    """
    build = _BUILDERS.get(type(message))
    if build is None:
        raise TypeError(
            "event_for: expected a RemoteBlocks, WriteDone, WriteFailed, Release, Heartbeat or "
            f"LeaseGranted message, got {type(message).__name__}"
        )
    return build(message, now, source)

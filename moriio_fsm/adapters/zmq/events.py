"""Turns decoded notify messages into the machines' runtime events.

Rules: the only module of the zmq adapter that knows runtime event names; the wire
codec stays free of them. Each event carries the message's fields and its ``source``.
"""

from __future__ import annotations

from typing import Callable

from moriio_fsm.runtime.declared import events
from moriio_fsm.runtime.events import Event

from .codec import NotifyMessage, Release, RemoteBlocks, WriteDone, WriteFailed

__all__ = ["event_for"]


def _remote_blocks(message: RemoteBlocks, now: float, source: str) -> Event:
    return events.remote_blocks(message.transfer_id, now, message.block_ids, message.decode_rank,
                                message.req_id, source=source)


def _write_done(message: WriteDone, now: float, source: str) -> Event:
    # Absent on the wire means the one writer upstream assumes.
    writers = 1 if message.num_writers is None else message.num_writers
    return events.write_done(message.transfer_id, now, writers, source=source)


def _write_failed(message: WriteFailed, now: float, source: str) -> Event:
    return events.write_failed(message.transfer_id, now, source=source)


def _release(message: Release, now: float, source: str) -> Event:
    # Absent on the wire means one D rank releases.
    size = 1 if message.consumer_tp_size is None else message.consumer_tp_size
    return events.release(message.transfer_id, now, size, source=source)


_BUILDERS: dict[type, Callable[..., Event]] = {
    RemoteBlocks: _remote_blocks,
    WriteDone: _write_done,
    WriteFailed: _write_failed,
    Release: _release,
}


def event_for(message: NotifyMessage, now: float, source: str = "") -> Event:
    """The runtime event ``message`` stands for, received at ``now`` from ``source``.

    ``source`` names the sending peer (``Delivery.source``); "" when unknown. Raises
    ``TypeError`` for anything but a decoded notify message.
    """
    build = _BUILDERS.get(type(message))
    if build is None:
        raise TypeError(
            "event_for: expected a RemoteBlocks, WriteDone, WriteFailed or Release message, "
            f"got {type(message).__name__}"
        )
    return build(message, now, source)

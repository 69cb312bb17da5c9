"""Turns decoded notify messages into the machines' runtime events.

Rules: the only module of the zmq adapter that knows runtime event names; the wire
codec stays free of them. Each event carries the message's fields and its ``source``.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Callable

from moriio_fsm.runtime.events import Event

from .codec import NotifyMessage, Release, RemoteBlocks, WriteDone, WriteFailed

__all__ = ["event_for"]


def _remote_blocks(message: RemoteBlocks, now: float, source: str) -> Event:
    data = {"block_ids": message.block_ids, "decode_rank": message.decode_rank, "req_id": message.req_id}
    return Event(message.transfer_id, "remote_blocks", now, MappingProxyType(data), source)


def _write_done(message: WriteDone, now: float, source: str) -> Event:
    # Absent on the wire means the one writer upstream assumes.
    writers = 1 if message.num_writers is None else message.num_writers
    return Event(message.transfer_id, "write_done", now, MappingProxyType({"num_writers": writers}), source)


def _write_failed(message: WriteFailed, now: float, source: str) -> Event:
    return Event(message.transfer_id, "write_failed", now, source=source)


def _release(message: Release, now: float, source: str) -> Event:
    # Absent on the wire means one D rank releases.
    size = 1 if message.consumer_tp_size is None else message.consumer_tp_size
    return Event(message.transfer_id, "release", now, MappingProxyType({"consumer_tp_size": size}), source)


_BUILDERS: dict[type, Callable[..., Event]] = {
    RemoteBlocks: _remote_blocks,
    WriteDone: _write_done,
    WriteFailed: _write_failed,
    Release: _release,
}


def event_for(message: NotifyMessage, now: float, source: str = "") -> Event:
    """The runtime event ``message`` stands for, received at ``now`` from ``source``.

    ``source`` names the sending peer (``Delivery.source``); "" when unknown.  Its data
    is read-only.  Raises ``TypeError`` for anything but a decoded notify message.
    """
    build = _BUILDERS.get(type(message))
    if build is None:
        raise TypeError(
            "event_for: expected a RemoteBlocks, WriteDone, WriteFailed or Release message, "
            f"got {type(message).__name__}"
        )
    return build(message, now, source)

"""The stand-in engines alive in this process, for the transfer thread to find the other side of a transfer.

Rules: the registry holds engines weakly (an engine Python let go of is gone, as its native side would be); an
engine is found by its descriptor's key, host, port and process, the newest first.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

from .mover import RegionTable, RemoteRegion

__all__ = ["add", "find_regions", "notify_inbound", "with_key"]

_lock = threading.Lock()
_engines: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
_serial = 0


def add(engine: Any) -> None:
    """Make ``engine`` findable while it lives."""
    global _serial
    with _lock:
        _serial += 1
        _engines[_serial] = engine


def with_key(key: str) -> list[Any]:
    """The live engines named ``key``, newest first."""
    with _lock:
        found = [
            (serial, engine) for serial, engine in _engines.items() if engine.standin_key == key
        ]
    return [engine for _, engine in sorted(found, key=lambda item: item[0], reverse=True)]


def find_regions(remote: RemoteRegion) -> RegionTable | None:
    """The region table of the live engine ``remote`` names, or None when it is gone."""
    for engine in with_key(remote.engine_key):
        if engine.standin_answers_at(remote.host, remote.port, remote.pid):
            return engine.standin_regions
    return None


def notify_inbound(remote: RemoteRegion, initiator_key: str, uid: int) -> None:
    """Tell the live engine ``remote`` names that ``initiator_key``'s transfer ``uid`` landed in it."""
    for engine in with_key(remote.engine_key):
        if engine.standin_answers_at(remote.host, remote.port, remote.pid):
            engine.standin_inbound(initiator_key, uid)
            return

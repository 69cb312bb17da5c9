"""What the stand-in saw that would be undefined behaviour in native mori, recorded for tests to assert on.

Rules: an incident is recorded and logged, never raised (native mori would not raise either: it would write into
freed memory); ``take`` hands the record over and empties it.
"""

from __future__ import annotations

import logging
import threading

__all__ = ["record", "take"]

_log = logging.getLogger("moriio_fsm.engines.mori_standin")
_lock = threading.Lock()
_seen: list[str] = []


def record(what: str) -> None:
    """Note one incident (``what`` says it in words)."""
    with _lock:
        _seen.append(what)
    _log.error("[mori stand-in] %s", what)


def take() -> list[str]:
    """Every incident since the last call, oldest first."""
    with _lock:
        seen = list(_seen)
        _seen.clear()
    return seen

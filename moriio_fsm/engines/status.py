"""Transfer status codes and the status object every engine hands back, with mori.io's codes and rules.

Rules: INIT, then IN_PROGRESS when posted, then SUCCESS or an error code above 10; once final a status never
changes again, so the first error wins.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Protocol, runtime_checkable

from ..runtime.timers import is_time

__all__ = [
    "StatusCode",
    "TransferStatus",
    "LocalTransferStatus",
    "failed_status",
    "wait_all",
]


class StatusCode(enum.IntEnum):
    """mori.io's ``StatusCode`` values; any code above 10 is a failure."""

    SUCCESS = 0
    INIT = 1
    IN_PROGRESS = 2
    ERR_INVALID_ARGS = 11
    ERR_NOT_FOUND = 12
    ERR_RDMA_OP = 13
    ERR_BAD_STATE = 14
    ERR_GPU_OP = 15


_FIRST_ERROR_CODE = 11

_log = logging.getLogger(__name__)


def code_is_failure(code: int) -> bool:
    """True for every code mori.io counts as a failure (above 10)."""
    return code >= _FIRST_ERROR_CODE


@runtime_checkable
class TransferStatus(Protocol):
    """The completion handle of one posted write/read (or batch of them).

    Every query is non-blocking except ``wait`` and ``wait_for``. A status is
    *final* when it succeeded or failed; final statuses never change. A final status
    means no byte of its transfer can still move: an engine whose failed transfer may
    still be writing reports it in progress (mori.io, see ``mori_status.py``).
    """

    def code(self) -> int: ...
    def message(self) -> str: ...
    def init(self) -> bool: ...
    def in_progress(self) -> bool: ...
    def succeeded(self) -> bool: ...
    def failed(self) -> bool: ...
    def wait(self) -> int: ...
    def wait_for(self, timeout_ms: int = -1) -> bool: ...


class LocalTransferStatus:
    """A thread-safe status completed by Python code (the loopback engine).

    Guarantees: reads never block; ``settle`` is idempotent and only the first
    final code sticks; waiters wake exactly when the status becomes final, and so
    does each ``when_final`` callback, once.
    """

    __slots__ = (
        "_code",
        "_message",
        "_lock",
        "_final",
        "_final_at",
        "_waiters",
        "_callbacks",
        "__weakref__",
    )

    def __init__(self) -> None:
        self._code = int(StatusCode.INIT)
        self._message = ""
        self._lock = threading.Lock()
        self._final = False
        self._final_at: float | None = None
        # Made by the first waiter: most statuses are never waited for (a transfer posts one
        # per layer and hears of it by callback), and a Condition costs more than the rest.
        self._waiters: threading.Condition | None = None
        self._callbacks: list[Callable[[], object]] | None = None

    # -- mori's query surface -------------------------------------------------
    def code(self) -> int:
        return self._code

    def message(self) -> str:
        return self._message

    def init(self) -> bool:
        return self._code == StatusCode.INIT

    def in_progress(self) -> bool:
        return self._code == StatusCode.IN_PROGRESS

    def succeeded(self) -> bool:
        return self._code == StatusCode.SUCCESS

    def failed(self) -> bool:
        return code_is_failure(self._code)

    def is_final(self) -> bool:
        return self._final

    def final_at(self) -> float | None:
        """When (``time.monotonic``) the transfer ended, as its engine saw it; None while not final.

        An engine that settles statuses after more work (letting go of registrations, copying
        others) gives each the time its copy was seen to end, so that a completion event made
        later still carries that time.
        """
        return self._final_at

    def wait(self) -> int:
        """Block until final; returns the final code."""
        self.wait_for(-1)
        return self._code

    def wait_for(self, timeout_ms: int = -1) -> bool:
        """Block up to ``timeout_ms`` (negative: forever); True if now final."""
        if self._final:
            return True
        with self._lock:
            if self._waiters is None:
                self._waiters = threading.Condition(self._lock)
            if timeout_ms is None or timeout_ms < 0:
                while not self._final:
                    self._waiters.wait()
                return True
            return self._waiters.wait_for(lambda: self._final, timeout_ms / 1000.0)

    def when_final(self, callback: Callable[[], object]) -> None:
        """Call ``callback()`` once the status is final: now if it already is, else from ``settle``.

        For a watcher that would otherwise poll (the completion poller): it runs on the
        thread that settles, so it must be quick and must not raise (what it raises is
        logged and dropped, never the settling engine's problem).
        """
        if not callable(callback):
            raise TypeError(f"callback must be callable, got {type(callback).__name__}")
        with self._lock:
            if not self._final:
                if self._callbacks is None:
                    self._callbacks = []
                self._callbacks.append(callback)
                return
        _call_quietly(callback)

    # -- engine side ----------------------------------------------------------
    def mark_in_progress(self) -> None:
        """INIT -> IN_PROGRESS; a status that is already final stays final."""
        with self._lock:
            if self._code == StatusCode.INIT:
                self._code = int(StatusCode.IN_PROGRESS)

    def settle(self, code: int, message: str = "", ended_at: float | None = None) -> bool:
        """Make the status final with ``code``; returns False if it already was.

        ``code`` must be SUCCESS or a failure code: INIT and IN_PROGRESS are not
        final and would leave waiters hanging. ``ended_at``: when the transfer ended
        (``time.monotonic``; now when None), at most now.
        """
        code = int(code)
        if code != StatusCode.SUCCESS and not code_is_failure(code):
            raise ValueError(
                f"status code {code} is not final; expected SUCCESS (0) or a failure code above 10"
            )
        now = time.monotonic()
        if ended_at is None:
            ended_at = now
        elif ended_at.__class__ is not float or not is_time(ended_at) or not ended_at <= now:
            # NaN, infinities, out of any clock's range, not a float, or the future
            raise ValueError(
                f"ended_at must be a time.monotonic() reading not after now, got {ended_at!r}"
            )
        with self._lock:
            if self._final:
                return False
            self._message = message
            self._code = code
            self._final_at = ended_at
            self._final = True
            if self._waiters is not None:
                self._waiters.notify_all()
            callbacks, self._callbacks = self._callbacks, None
        for callback in callbacks or ():
            _call_quietly(callback)
        return True

    def __repr__(self) -> str:
        try:
            name = StatusCode(self._code).name
        except ValueError:
            name = str(self._code)
        suffix = f" {self._message!r}" if self._message else ""
        return f"<LocalTransferStatus {name}{suffix}>"


def _call_quietly(callback: Callable[[], object]) -> None:
    try:
        callback()
    except Exception:
        _log.exception("a status's when_final callback raised")


def failed_status(code: int, message: str) -> LocalTransferStatus:
    """A status that is already final with a failure, as mori returns for bad arguments."""
    status = LocalTransferStatus()
    status.settle(code, message)
    return status


def _is_final(status: TransferStatus) -> bool:
    return not (status.init() or status.in_progress())


def wait_all(statuses: Iterable[TransferStatus], timeout_ms: int = -1) -> bool:
    """Wait until every status is final or ``timeout_ms`` passes (negative: forever).

    Returns True when all are final (succeeded or failed); False on timeout.
    A status that is never posted (stuck at INIT) counts as not final.
    """
    pending = list(statuses)
    if timeout_ms is None or timeout_ms < 0:
        for status in pending:
            status.wait()
        return True
    deadline = time.monotonic() + timeout_ms / 1000.0
    for status in pending:
        if _is_final(status):
            continue
        left_ms = int((deadline - time.monotonic()) * 1000)
        if left_ms <= 0 or not status.wait_for(left_ms):
            return _is_final(status) and all(_is_final(s) for s in pending)
    return True

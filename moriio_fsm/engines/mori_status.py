"""Our status surface over mori.io's ``TransferStatus``, and the keeper of every status mori may still write into.

Rules: a status is final here only when no byte of its transfer can still move. mori fails a status while earlier
writes of the batch may still be in flight (a send queue that filled part-way, a failed notification, an error
completion on one of several queue pairs), so such a failure is reported as still in progress and never final:
the machines then tear the transfer down, and as mori cannot stop it, keep its blocks out of use. Only the
failures mori reports before posting anything (bad arguments, unknown memory) are final failures. The keeper
holds every status mori may still write into (its native side keeps only a raw pointer) for the life of the
engine, dropping only those that succeeded or failed before posting.
"""

from __future__ import annotations

import threading
from typing import Any

from .status import StatusCode, code_is_failure

__all__ = ["C_INT_MAX", "MoriStatus", "StatusKeeper", "wait_ms"]

#: The largest timeout mori's ``WaitFor(int timeoutMs)`` takes (a C++ int).
C_INT_MAX = (1 << 31) - 1

# Failures mori reports before it posts a single work request: nothing of the transfer can still move.
_NOTHING_POSTED = frozenset({int(StatusCode.ERR_INVALID_ARGS), int(StatusCode.ERR_NOT_FOUND)})


def wait_ms(timeout_ms: Any) -> int:
    """A timeout as mori's ``WaitFor`` takes it: -1 for none (None or negative), else at most a C++ int."""
    if timeout_ms is None or timeout_ms < 0:
        return -1
    return min(int(timeout_ms), C_INT_MAX)


class MoriStatus:
    """One posted batch's status, over mori's own (CamelCase methods)."""

    __slots__ = ("_raw",)

    def __init__(self, raw: Any) -> None:
        self._raw = raw

    # -- what mori says ---------------------------------------------------------------------------

    def native_code(self) -> int:
        """mori's own code for the transfer (a failure here may still have writes in flight)."""
        return int(self._raw.Code())

    def native_message(self) -> str:
        return str(self._raw.Message())

    def writes_may_continue(self) -> bool:
        """Whether mori failed the transfer after posting some of it: its writes may still land."""
        code = self.native_code()
        return code_is_failure(code) and code not in _NOTHING_POSTED

    # -- the engines' status surface ----------------------------------------------------------------

    def code(self) -> int:
        code = self.native_code()
        if code_is_failure(code) and code not in _NOTHING_POSTED:
            return int(StatusCode.IN_PROGRESS)
        return code

    def message(self) -> str:
        code, message = self.native_code(), self.native_message()
        if code_is_failure(code) and code not in _NOTHING_POSTED:
            return (
                f"mori reported {_name(code)}: {message}; writes of this transfer may still land, so it stays "
                "in flight until it is torn down"
            )
        return message

    def init(self) -> bool:
        return self.code() == StatusCode.INIT

    def in_progress(self) -> bool:
        return self.code() == StatusCode.IN_PROGRESS

    def succeeded(self) -> bool:
        return self.code() == StatusCode.SUCCESS

    def failed(self) -> bool:
        return code_is_failure(self.code())

    def is_final(self) -> bool:
        code = self.code()
        return code == StatusCode.SUCCESS or code_is_failure(code)

    def wait(self) -> int:
        """Wait for mori's side to settle; the code then (IN_PROGRESS for a failure whose writes may go on)."""
        self._raw.Wait()
        return self.code()

    def wait_for(self, timeout_ms: int = -1) -> bool:
        """Wait up to ``timeout_ms`` (negative or None: no limit); True if final."""
        self._raw.WaitFor(wait_ms(timeout_ms))
        return self.is_final()

    def __repr__(self) -> str:
        return f"<MoriStatus code={self.code()} native={self.native_code()} {self.message()!r}>"


def _name(code: int) -> str:
    try:
        return f"{StatusCode(code).name} ({code})"
    except ValueError:
        return str(code)


class StatusKeeper:
    """Every status mori may still write into, kept referenced; ``keep`` is amortised O(1).

    The list is swept only when it has doubled since the last sweep, so each post pays for at most a couple of
    status queries however many are kept, and memory stays within twice the number kept.
    """

    _MIN_SWEEP_AT = 64

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._kept: list[MoriStatus] = []
        self._sweep_at = self._MIN_SWEEP_AT

    def keep(self, status: MoriStatus) -> None:
        with self._lock:
            self._kept.append(status)
            if len(self._kept) >= self._sweep_at:
                self._sweep()

    def _sweep(self) -> None:
        self._kept = [status for status in self._kept if not _done_with(status)]
        self._sweep_at = max(2 * len(self._kept), self._MIN_SWEEP_AT)

    def __len__(self) -> int:
        with self._lock:
            self._sweep()
            return len(self._kept)


def _done_with(status: MoriStatus) -> bool:
    """Whether mori can no longer write into ``status``: it succeeded (the last completion wrote it) or failed
    before anything was posted."""
    code = status.native_code()
    return code == StatusCode.SUCCESS or code in _NOTHING_POSTED

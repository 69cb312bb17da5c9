"""mori's ``TransferStatus`` (``common.hpp``): owned by Python, written by the stand-in's transfer thread.

Rules, mori's: ``Update`` ignores every change once the code is a failure (only failures stick; a success can
still be overwritten by a later failure), ``SetCode`` always writes; ``WaitFor`` returns at once unless the code is
IN_PROGRESS, negative waits without limit, 0 polls, and a bounded wait may end IN_PROGRESS. Not copyable.
"""

from __future__ import annotations

import threading
import time

from .binding import INT, STR, Param, enum_of, signature
from .codes import FIRST_ERROR, StatusCode

__all__ = ["TransferStatus"]

_IN_PROGRESS = 2
_INIT = 1
_SUCCESS = 0
_CODE = enum_of(StatusCode)


class TransferStatus:
    """One transfer's code and message; the stand-in's transfer thread updates it from another thread."""

    __slots__ = ("_code", "_message", "_changed", "__weakref__")

    @signature("TransferStatus")
    def __init__(self) -> None:
        self._code = _INIT
        self._message = ""
        self._changed = threading.Condition()

    @signature("TransferStatus", returns="mori.cpp.StatusCode")
    def Code(self):
        return StatusCode.fresh(self._code)

    @signature("TransferStatus", returns="str")
    def Message(self) -> str:
        with self._changed:
            return self._message

    @signature("TransferStatus", Param(_CODE), Param(STR))
    def Update(self, code, message: str) -> None:
        self.update(int(code), message)

    @signature("TransferStatus", returns="bool")
    def Init(self) -> bool:
        return self._code == _INIT

    @signature("TransferStatus", returns="bool")
    def InProgress(self) -> bool:
        return self._code == _IN_PROGRESS

    @signature("TransferStatus", returns="bool")
    def Succeeded(self) -> bool:
        return self._code == _SUCCESS

    @signature("TransferStatus", returns="bool")
    def Failed(self) -> bool:
        return self._code > FIRST_ERROR

    @signature("TransferStatus", Param(_CODE))
    def SetCode(self, code) -> None:
        self.set_code(int(code))

    @signature("TransferStatus", Param(STR))
    def SetMessage(self, message: str) -> None:
        with self._changed:
            self._message = message

    @signature("TransferStatus")
    def Wait(self) -> None:
        self.wait_code(-1)

    @signature("TransferStatus", Param(INT, "timeout_ms", -1), returns="mori.cpp.StatusCode")
    def WaitFor(self, timeout_ms: int):
        return StatusCode.fresh(self.wait_code(timeout_ms))

    # -- the native side ------------------------------------------------------------------------

    def update(self, code: int, message: str) -> None:
        """mori's ``Update``: a failure already recorded wins over anything later."""
        with self._changed:
            if self._code > FIRST_ERROR:
                return
            self._message = message
            self._code = code
            self._changed.notify_all()

    def set_code(self, code: int) -> None:
        """mori's ``SetCode``: writes whatever the code is now."""
        with self._changed:
            self._code = code
            self._changed.notify_all()

    def wait_code(self, timeout_ms: int) -> int:
        """mori's ``WaitFor``, for the native side: the code as an int."""
        with self._changed:
            if self._code != _IN_PROGRESS or timeout_ms == 0:
                return self._code
            if timeout_ms < 0:
                self._changed.wait_for(lambda: self._code != _IN_PROGRESS)
                return self._code
            deadline = time.monotonic() + timeout_ms / 1000.0
            while self._code == _IN_PROGRESS and (left := deadline - time.monotonic()) > 0:
                self._changed.wait(left)
            return self._code

    def __copy__(self):
        raise TypeError("mori.cpp.TransferStatus is not copyable")

    def __deepcopy__(self, memo):
        raise TypeError("mori.cpp.TransferStatus is not copyable")

    def __reduce_ex__(self, protocol):
        raise TypeError("cannot pickle 'mori.cpp.TransferStatus' object")

    def __repr__(self) -> str:
        return f"<mori.cpp.TransferStatus object (stand-in) code={self._code}>"

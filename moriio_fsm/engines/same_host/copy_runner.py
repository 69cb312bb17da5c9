"""Carrying out due batches of the same-host engine: writes on a peer's board first, the others
grouped by destination process and copied by the first copy strategy that takes their group.

Rules: bytes move only while both registrations of a batch are held; one failing group never
ends the calling thread (its batches fail instead); copies running now are counted for waiters.
"""

from __future__ import annotations

import logging
import threading
import time

from ..status import StatusCode
from .assisted import AssistedCopy
from .copying import KernelCopy, PageCopy
from .session import SameHostPost
from .strategy import CopyStrategy

__all__ = ["CopyRunner"]

# The engine's logger: its reports read as the engine's, wherever the code sits.
_log = logging.getLogger("moriio_fsm.engines.same_host.engine")


class CopyRunner:
    """Turns due batches into outcomes with the engine's three strategies, on any thread."""

    def __init__(self, kernel: KernelCopy, pages: PageCopy, assisted: AssistedCopy) -> None:
        self._kernel = kernel
        self._pages = pages
        self._assisted = assisted
        self._copying = 0  # threads in outcomes now
        self._copies_done = threading.Condition()

    def wait_idle(self, timeout_s: float) -> bool:
        """Block until no copy runs on any thread, at most ``timeout_s``; True if none runs."""
        with self._copies_done:
            return self._copies_done.wait_for(lambda: self._copying == 0, timeout_s)

    def outcomes(self, due: list[SameHostPost]) -> list[tuple[int, str, float | None]]:
        """(final code, message, when its copy ended) of each transfer."""
        with self._copies_done:
            self._copying += 1
        try:
            return self._outcomes_of(due)
        finally:
            with self._copies_done:
                self._copying -= 1
                if self._copying == 0:
                    self._copies_done.notify_all()

    def _outcomes_of(self, due: list[SameHostPost]) -> list[tuple[int, str, float | None]]:
        """Writes on a peer's board first, then the others grouped by where they go: copies bound for
        one process go as one run."""
        outcomes: list[tuple[int, str] | None] = [None] * len(due)
        on_board = [index for index, posted in enumerate(due) if posted.job is not None]
        if on_board:
            for index, outcome in zip(
                on_board, self._assisted.finish([due[index] for index in on_board])
            ):
                outcomes[index] = outcome
        groups: dict[tuple[str, int, bool], list[int]] = {}
        for index, posted in enumerate(due):
            if outcomes[index] is not None:
                continue
            if posted.failure is not None:
                outcomes[index] = posted.failure.code, posted.failure.message
            else:
                groups.setdefault(
                    (posted.op, posted.session.remote_mem.pid, posted.here), []
                ).append(index)
        for (op, pid, here), members in groups.items():
            try:
                for index, outcome in zip(
                    members, self._copy_together(op, pid, here, [due[i] for i in members])
                ):
                    outcomes[index] = outcome
            except Exception as exc:  # never let one transfer end the worker thread
                _log.exception("cross-memory transfer failed unexpectedly")
                for index in members:
                    outcomes[index] = StatusCode.ERR_BAD_STATE, str(exc)
        settled = [outcome for outcome in outcomes if outcome is not None]
        assert len(settled) == len(due), "every batch got its outcome above"
        return [(code, message, posted.ended_at) for posted, (code, message) in zip(due, settled)]

    def _copy_together(
        self, op: str, pid: int, here: bool, group: list[SameHostPost]
    ) -> list[tuple[int, str]]:
        """Carry out batches bound for process ``pid`` while each one's registrations are held, by the
        first strategy that takes them (``here``: the peer's memory is mapped in this process)."""
        problems = [posted.session.hold() for posted in group]
        held = [posted for posted, problem in zip(group, problems) if problem is None]
        try:
            reasons = dict(zip(map(id, held), self._copy_held(op, pid, here, held))) if held else {}
            # When these copies ended: before their registrations are let go, which is not copying.
            copied_at = time.monotonic()
            for posted in group:
                posted.ended_at = copied_at
        finally:
            for posted in held:
                posted.session.let_go()
        outcomes = []
        for posted, problem in zip(group, problems):
            reason = reasons.get(id(posted))
            outcomes.append(
                problem
                if problem is not None
                else posted.session.failure(reason)
                if reason is not None
                else posted.session.after_copy()
            )
        return outcomes

    def _copy_held(
        self, op: str, pid: int, here: bool, held: list[SameHostPost]
    ) -> list[str | None]:
        strategies: list[CopyStrategy] = [self._assisted, self._pages] if here else [self._kernel]
        for strategy in strategies:
            reasons = strategy.copy(op, pid, held)
            if reasons is not None:
                return reasons
        raise AssertionError("the last strategy takes every group")

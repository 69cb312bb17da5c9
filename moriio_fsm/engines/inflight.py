"""The in-flight core the project's engines share: a posted batch, the queue of those not carried out yet, and
the worker loop that carries them out and settles their statuses.

Rules: a batch is posted once and settled once (``LocalTransferStatus`` keeps the first final code); what a
fault verdict stalls or holds stays out of the due queue until its hold is released or the queue closes;
``close`` hands back every batch not carried out yet, for the engine to fail with ``closed_text``.
"""

from __future__ import annotations

import functools
import heapq
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from .checks import CheckedBatch
from .faults import NO_FAULT, FaultVerdict, InjectedFailure
from .status import LocalTransferStatus, StatusCode

__all__ = ["Posted", "PostQueue", "closed_text", "serve"]

_log = logging.getLogger(__name__)


def closed_text(key: str) -> str:
    """Why a batch ended unfinished because its engine closed."""
    return f"engine {key!r} closed before the transfer completed"


@dataclass(slots=True, eq=False)
class Posted:
    """One batch posted and not final yet: its status, its session, what it does, and the injected
    failure it must end with (None: it moves its bytes). Engines add what they track per batch."""

    status: LocalTransferStatus
    session: Any
    op: str
    batch: CheckedBatch
    failure: InjectedFailure | None = None

    @property
    def label(self) -> str:
        return f"batch_{self.op} uid {self.batch.transfer_uid}"

    def settle(self, code: int, message: str = "", ended_at: float | None = None) -> None:
        """Make the status final, its message (if any) labelled with this batch."""
        self.status.settle(code, f"{self.label}: {message}" if message else "", ended_at)

    def fail_closed(self, key: str) -> None:
        self.settle(StatusCode.ERR_BAD_STATE, closed_text(key))


#: What an engine queues: ``Posted`` or its own subclass of it.
PostedT = TypeVar("PostedT", bound=Posted)


class PostQueue(Generic[PostedT]):
    """Batches an engine's thread has yet to carry out: due ones in order of their time, stalled ones
    (never due), held ones (due once their ``HeldTransfers`` is released).

    ``take`` hands out what is due, at most ``most`` at a time (None: all); ``close`` ends it and hands
    back the rest.
    """

    def __init__(self, most: int | None = 1) -> None:
        self._most = most
        self._wake = threading.Condition()
        self._sequence = 0
        self._due: list[tuple[float, int, PostedT]] = []
        self._stalled: list[PostedT] = []
        self._held: dict[int, PostedT] = {}
        self.closed = False

    def number(self) -> int | None:
        """The next batch's number on this engine (1-based, what fault rules count); None once closed."""
        with self._wake:
            if self.closed:
                return None
            self._sequence += 1
            return self._sequence

    def put(self, posted: PostedT, sequence: int, verdict: FaultVerdict = NO_FAULT) -> bool:
        """Queue a batch as the faults' ``verdict`` says: stalled, held, or due after its delay.
        False, queueing nothing, once closed."""
        with self._wake:
            if self.closed:
                return False
            if verdict.stall:
                self._stalled.append(posted)
            elif verdict.hold is not None and verdict.hold.keep(
                functools.partial(self._release, sequence)
            ):
                self._held[sequence] = posted  # under the lock, so that a release cannot come first
            else:
                heapq.heappush(self._due, (time.monotonic() + verdict.delay_s, sequence, posted))
                self._wake.notify()
            return True

    def put_due(self, numbered: Sequence[tuple[int, PostedT]]) -> bool:
        """Queue batches (each with its number) due now; False, queueing none, once closed."""
        with self._wake:
            if self.closed:
                return False
            now = time.monotonic()
            for sequence, posted in numbered:
                heapq.heappush(self._due, (now, sequence, posted))
            self._wake.notify()
            return True

    def _release(self, sequence: int) -> None:
        with self._wake:
            posted = self._held.pop(sequence, None)  # None: close already handed it back
            if posted is not None:
                heapq.heappush(self._due, (time.monotonic(), sequence, posted))
                self._wake.notify()

    def take(self, timeout_s: float | None = None) -> list[PostedT] | None:
        """Every batch due now (at least one, at most ``most``), waiting for one up to ``timeout_s`` (None:
        for ever); [] when the wait ran out; None once closed."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._wake:
            while not self.closed:
                now = time.monotonic()
                if self._due and self._due[0][0] <= now:
                    due: list[PostedT] = []
                    most = len(self._due) if self._most is None else self._most
                    while self._due and self._due[0][0] <= now and len(due) < most:
                        due.append(heapq.heappop(self._due)[2])
                    return due
                until = [deadline] if deadline is not None else []
                if self._due:
                    until.append(self._due[0][0])
                if deadline is not None and now >= deadline:
                    return []
                self._wake.wait(min(until) - now if until else None)
        return None

    def close(self) -> list[PostedT] | None:
        """Close the queue and wake its taker; every batch not handed out yet, for the caller to fail.
        None if it was closed already."""
        with self._wake:
            if self.closed:
                return None
            self.closed = True
            abandoned = (
                [entry[2] for entry in self._due] + self._stalled + list(self._held.values())
            )
            self._due, self._stalled, self._held = [], [], {}
            self._wake.notify_all()
        return abandoned


Outcome = tuple[int, str, "float | None"]  # final code, message, when the copy ended (None: now)


def serve(
    queue: PostQueue[PostedT],
    carry_out: Callable[[list[PostedT]], list[Outcome]],
    *,
    idle_s: float | None = None,
    on_idle: Callable[[], None] | None = None,
) -> None:
    """An engine's worker loop: carry out what is due, settle each status, until the queue closes.

    ``carry_out`` never raises (one batch's failure must not end the thread); ``on_idle`` runs after
    ``idle_s`` without a batch.
    """
    while (due := queue.take(idle_s)) is not None:
        if not due:
            if on_idle is not None:
                on_idle()
            continue
        outcomes = carry_out(due)
        statuses = [(posted.status, posted.label) for posted in due]
        # Let go of the batches (their sessions, and the memory those map) before anyone woken
        # by a status can look for them.
        del due
        for (status, label), (code, message, ended_at) in zip(statuses, outcomes):
            status.settle(code, f"{label}: {message}" if message else "", ended_at)
        del statuses

"""CompletionPoller: turns transfer statuses into runtime events on its own thread.

Rules: ``submit`` only appends, so the posting (forward) thread never waits; non-blocking batched sweeps deliver
exactly one event per status, once final, unless its transfer was ``forget``-ten first; a status that can say when
it is final (``when_final``) wakes the thread at once, any other is polled every ``poll_interval_s``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from moriio_fsm.runtime.declared import make_event
from moriio_fsm.runtime.events import Event
from moriio_fsm.runtime.timers import is_time

from .status import StatusCode, TransferStatus

__all__ = ["CompletionPoller", "OPS"]

_log = logging.getLogger(__name__)

# op -> (event kind on success, event kind on failure)
OPS: dict[str, tuple[str, str]] = {
    "write": ("layer_write_completed", "layer_write_failed"),
    "read": ("layer_read_completed", "layer_read_failed"),
}


@dataclass(slots=True, eq=False)
class _Pending:
    status: TransferStatus
    transfer_id: str
    layer: int
    op: str
    wakes: bool = False  # the status calls back when final: no need to poll for it
    forgotten: bool = False


class CompletionPoller:
    """Watches statuses and calls ``deliver(event)`` from the poller thread.

    Guarantees: one event per submitted status, delivered after the status is
    final, except for statuses dropped by ``forget``; a ``deliver`` that raises is logged and counted, never fatal to the
    thread. A status with ``when_final`` (the project's own engines) wakes the thread
    as it settles, so its event goes out without a polling delay and an idle wait
    costs no wake-ups; ``poll_interval_s`` is the sleep between sweeps while statuses
    without it (mori.io's) are pending. ``batch_size`` bounds how many are queried per sweep so a flood of
    submissions cannot starve delivery. ``deliver`` must be thread-safe.

    An event's time is when its transfer ended: the status's ``final_at`` where it has one
    and ``clock`` is ``time.monotonic`` (the clock it is read on), else the sweep's time.
    """

    def __init__(
        self,
        deliver: Callable[[Event], object],
        *,
        poll_interval_s: float = 0.0005,
        batch_size: int = 256,
        clock: Callable[[], float] = time.monotonic,
        name: str = "moriio-completion-poller",
    ) -> None:
        if not callable(deliver):
            raise TypeError(f"deliver must be callable, got {type(deliver).__name__}")
        if not poll_interval_s > 0:
            raise ValueError(f"poll_interval_s must be > 0 seconds, got {poll_interval_s!r}")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
        self._deliver = deliver
        self._interval = poll_interval_s
        self._batch_size = batch_size
        self._clock = clock
        # Statuses that say when they ended say it on time.monotonic's clock: usable only then.
        self._status_times = clock is time.monotonic
        self._incoming: deque[_Pending] = deque()
        self._wake = threading.Condition()
        self._stopping = False
        self._pending: deque[_Pending] = deque()
        self._sweeping: list[_Pending] = []  # taken off _pending by the current sweep
        self._nudged = False  # a status settled since the last sweep began
        self._undelivered = 0
        self.delivered = 0
        self.delivery_errors = 0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(
        self, status: TransferStatus, transfer_id: str, layer: int, op: str = "write"
    ) -> None:
        """Watch ``status`` for (transfer_id, layer, op); returns at once.

        Raises ``ValueError`` for an unknown op or a negative layer, ``TypeError``
        for a transfer id that is not a string, ``RuntimeError`` after ``close``.
        """
        if op not in OPS:
            raise ValueError(f"op must be one of {sorted(OPS)}, got {op!r}")
        if not isinstance(transfer_id, str) or not transfer_id:
            raise TypeError(f"transfer_id must be a non-empty string, got {transfer_id!r}")
        if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0:
            raise ValueError(f"layer must be a non-negative integer, got {layer!r}")
        when_final = getattr(status, "when_final", None)
        entry = _Pending(status, transfer_id, layer, op, wakes=callable(when_final))
        with self._wake:
            if self._stopping:
                raise RuntimeError("the completion poller is closed")
            self._incoming.append(entry)
            self._undelivered += 1
            self._wake.notify()
        if callable(when_final):  # entry.wakes
            when_final(self._nudge)  # outside the lock: a status already final calls back at once

    def event_if_final(
        self, status: TransferStatus, transfer_id: str, layer: int, op: str = "write"
    ) -> Event | None:
        """The event of a status that is final already (an engine that copied as it posted), else None.

        For the poster to dispatch itself rather than ``submit``: the event goes out at once,
        with no hand-off to this thread. Exactly one of the two must be used per status.
        """
        if op not in OPS:
            raise ValueError(f"op must be one of {sorted(OPS)}, got {op!r}")
        if status.init() or status.in_progress():
            return None
        return self._event(_Pending(status, transfer_id, layer, op), self._ended_at(status))

    def _nudge(self) -> None:
        """A watched status just settled (called on the settling thread)."""
        with self._wake:
            self._nudged = True
            self._wake.notify()

    def forget(self, transfer_id: str) -> int:
        """Stop watching every status of ``transfer_id``; returns how many were dropped.

        For a transfer that was abandoned: its statuses will never produce an
        event, even if they become final later, and no longer cost a query per
        sweep. An event already being handed to ``deliver`` is not recalled.
        Dropping the poller's reference is safe for mori.io statuses, which
        ``MoriEngine`` keeps referenced until they are final.
        """
        if not isinstance(transfer_id, str) or not transfer_id:
            raise TypeError(f"transfer_id must be a non-empty string, got {transfer_id!r}")
        with self._wake:
            dropped = 0
            for name in ("_incoming", "_pending"):
                entries = getattr(self, name)
                kept = deque(e for e in entries if e.transfer_id != transfer_id)
                dropped += len(entries) - len(kept)
                setattr(self, name, kept)
            for entry in self._sweeping:
                if entry.transfer_id == transfer_id and not entry.forgotten:
                    entry.forgotten = True
                    dropped += 1
            self._undelivered -= dropped
            return dropped

    @property
    def pending(self) -> int:
        """Statuses submitted whose event has not been handed to ``deliver`` yet."""
        with self._wake:
            return self._undelivered

    def close(self, timeout_s: float | None = 5.0) -> int:
        """Stop the thread; returns how many statuses were still pending (not delivered)."""
        with self._wake:
            self._stopping = True
            self._wake.notify_all()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout_s)
        with self._wake:
            return self._undelivered

    def __enter__(self):
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    # -- the poller thread ----------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._stopping and not self._incoming and not self._pending:
                    self._wake.wait()
                if self._stopping:
                    return
                self._pending.extend(self._incoming)
                self._incoming.clear()
                pending = self._pending
                batch = [pending.popleft() for _ in range(min(self._batch_size, len(pending)))]
                self._sweeping = batch
                self._nudged = False
                # Sleeping until woken is safe only when this sweep sees every pending status
                # and each of them calls back when it settles.
                idle_until_woken = not pending and all(entry.wakes for entry in batch)
            finished = self._sweep(batch)
            for event in finished:
                self._emit(event)
            if not finished:
                with self._wake:
                    if not self._stopping and not self._incoming and not self._nudged:
                        self._wake.wait(None if idle_until_woken else self._interval)

    def _sweep(self, batch: list[_Pending]) -> list[Event]:
        """Query one batch without the lock; requeue the unfinished, skip the forgotten."""
        final, unfinished = [], []
        for entry in batch:
            status = entry.status
            if status.init() or status.in_progress():
                unfinished.append(entry)
            else:
                final.append(entry)
        with self._wake:
            self._sweeping = []
            self._pending.extend(e for e in unfinished if not e.forgotten)
            final = [e for e in final if not e.forgotten]
        if not final:
            return []
        now = self._clock()
        return [self._event(entry, self._ended_at(entry.status, now)) for entry in final]

    def _ended_at(self, status: TransferStatus, now: float | None = None) -> float:
        """When a final status's transfer ended, on this poller's clock, never after ``now``."""
        now = self._clock() if now is None else now
        final_at = getattr(status, "final_at", None) if self._status_times else None
        ended = final_at() if callable(final_at) else None
        # Only a plain float reading of the past the table takes: a status of unknown make may
        # say anything, and a completion the table refused would leave its layer in flight.
        return ended if ended.__class__ is float and is_time(ended) and ended <= now else now

    @staticmethod
    def _event(entry: _Pending, now: float) -> Event:
        completed, failed = OPS[entry.op]
        status = entry.status
        code = status.code()
        if code == StatusCode.SUCCESS:
            return make_event(completed, entry.transfer_id, now, {"layer": entry.layer})
        return make_event(
            failed,
            entry.transfer_id,
            now,
            {"layer": entry.layer, "code": int(code), "message": status.message()},
        )

    def _emit(self, event: Event) -> None:
        try:
            self._deliver(event)
        except Exception:
            self.delivery_errors += 1
            _log.exception("delivering %s for %s failed", event.kind, event.transfer_id)
        else:
            self.delivered += 1
        finally:
            with self._wake:
                self._undelivered -= 1

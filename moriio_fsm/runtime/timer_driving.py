"""Driving a table's timers: firing the due ones, the check that a timer event is due,
arming, and the audit that every armed timer can fire.

Rules (the timer rules themselves are ``TimerPlan``'s, ``timers.py``): a timer event
counts only when its slot's deadline is due, so a stale or early one is IGNORED; a
slot is cleared while its step runs and armed again, with a heap entry of its own, if
the step fails; a fired step is recorded like a dispatched one; one broken timer never
holds up the others. ``TimerDriving`` is the part of ``TransferTable`` that does it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .errors import TimerStepsFailed, TransitionError
from .events import Event, Outcome, Result
from .shard import Shard
from .timers import check_time

if TYPE_CHECKING:
    from .recording import Recorder, StepRecord, StepRecorder
    from .timers import DeadlineHeap, TimerPlan


_REJECTED = Outcome.REJECTED
_NO_EFFECTS: tuple = ()


class TimerDriving:
    """Timer methods of ``TransferTable``. They use the table's ``_heap``, ``_plan``,
    ``_shards``, ``_mask``, ``_timer_events``, ``_run_step``, the recorders and
    ``executor``."""

    if TYPE_CHECKING:  # what the table provides (its __init__ and methods, and Admission)
        executor: str
        _heap: DeadlineHeap
        _plan: TimerPlan
        _shards: tuple[Shard, ...]
        _mask: int
        _timer_events: tuple[type[Event], ...]
        _step_record: StepRecord | None
        _recorder: Recorder | StepRecorder | None

        def _run_step(self, shard: Shard, tx: Any, ev: Event) -> Result: ...

        def _record_step(
            self, ev: Event, before: Any, result: Any, rows: Any, *error: Any
        ) -> None: ...

        def _record(self, ev: Event, result: Result) -> None: ...

    def advance(self, now: float) -> list[tuple[Event, Result]]:
        """Fire every timer whose deadline is <= ``now``, earliest first; return the
        fired events with their results. Deadlines pushed back by progress are
        re-queued, not fired. ``now`` must be a clock reading (``ValueError``).

        A timer step that raises does not stop the others: every due timer fires, then
        ``TimerStepsFailed`` carries the results of those that ran and the errors; the
        failed timer stays armed and is retried one duration later."""
        check_time(now, "advance(now)")
        fired: list[tuple[Event, Result]] = []
        errors: list[TransitionError] = []
        while True:
            due = self._heap.pop_due(now)
            if due is None:
                break
            deadline, tx, index = due
            shard = self._shards[hash(tx.transfer_id) & self._mask]
            shard.lock.acquire()
            try:
                current = tx.deadlines[index]
                if current is None or not shard.holds(tx):
                    continue  # disarmed or retired
                if current > deadline:
                    self._heap.push(current, tx, index)  # restarted since pushed
                    continue
                ev = self._timer_events[index](tx.transfer_id, current)
                before = tx.state
                shard.fired = () if self.executor == "compiled" else None
                try:
                    result = self._run_step(shard, tx, ev)
                except TransitionError as exc:
                    # Rolled back with its slot armed again: retry it later, not now, so
                    # one broken transfer cannot hold up every other timer.
                    retry = now + self._plan.durations[index]
                    tx.deadlines[index] = retry
                    self._heap.push(retry, tx, index)
                    errors.append(exc)
                    if self._step_record is not None:
                        self._record_step(ev, before, None, shard.fired, exc)
                    continue
                if self._step_record is not None:
                    self._record_step(ev, before, result, shard.fired)
                elif self._recorder is not None:
                    self._record(ev, result)
            finally:
                shard.lock.release()
            fired.append((ev, result))
        if errors:
            raise TimerStepsFailed(fired, errors)
        return fired

    def next_deadline(self) -> float | None:
        """The earliest pending deadline (possibly stale), for a driver's sleep."""
        return self._heap.earliest()

    def audit(self) -> list[str]:
        """Problems with the timers of live transfers: an armed slot whose heap entry is
        missing or later than its deadline would never fire. Empty when sound."""
        entries = self._heap.entries_for()
        problems = []
        for shard in self._shards:
            with shard.lock:
                for tx in shard.live.values():
                    for index, deadline in enumerate(tx.deadlines):
                        if deadline is None:
                            continue
                        pushed = entries.get((id(tx), index))
                        if pushed is None or pushed > deadline:
                            problems.append(
                                f"transfer {tx.transfer_id!r} in state {tx.state!r}: "
                                f"timer {self._plan.names[index]!r} is armed for "
                                f"{deadline} but the heap holds "
                                f"{'no entry' if pushed is None else pushed}"
                            )
        return problems

    def _arm(self, tx, index: int, now: float) -> None:
        deadline = now + self._plan.durations[index]
        tx.deadlines[index] = deadline
        self._heap.push(deadline, tx, index)

    def _timer_step(self, index: int, step, shard: Shard, tx, ev: Event) -> Result:
        deadline = tx.deadlines[index]
        if deadline is None or deadline > ev.time:
            shard.counts[Outcome.IGNORED.index] += 1
            return Result(Outcome.IGNORED, tx.state, _NO_EFFECTS)  # stale or early timer
        if step is None:
            shard.counts[_REJECTED.index] += 1
            return Result(_REJECTED, tx.state, _NO_EFFECTS)
        # The slot is cleared before the step runs and comes back if the step fails, with a
        # heap entry of its own (a compaction meanwhile may have dropped the old one).
        tx.deadlines[index] = None
        try:
            return step(shard, tx, ev)
        except BaseException:
            tx.deadlines[index] = deadline
            self._heap.push(deadline, tx, index)
            raise

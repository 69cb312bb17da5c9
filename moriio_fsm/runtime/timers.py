"""Timers: what a step does to a transfer's deadlines, and the one heap they wait in.

Rules: a timer is armed on entry into its states (or re-entry after it fired),
disarmed on leaving them, pushed back by an applied ``restart_on`` event while the
transfer is in them, and cleared when it fires. ``TimerPlan`` is the single statement of
these rules; the generated steps inline its restart operations and the table runs its
hop operations, so there is one definition, not two. ``DeadlineHeap`` holds one entry
per arming, keyed by the transfer record itself (never looked up by id), so an entry
survives any compaction for as long as its slot is armed.
"""

from __future__ import annotations

import heapq
import itertools
import threading
from typing import Any

from ..lang.model import Spec

#: Operations on one timer slot when a transfer moves from one state to another.
LEAVE, ENTER, STAY = "leave", "enter", "stay"


class TimerPlan:
    """The timers of one spec with durations resolved from the config."""

    def __init__(self, spec: Spec, config: dict[str, Any]):
        timers = list(spec.timers.values())
        self.names = tuple(timer.name for timer in timers)
        self.events = tuple(timer.event for timer in timers)
        self.index_of_event = {timer.event: i for i, timer in enumerate(timers)}
        self.durations = tuple(float(config[timer.duration_key]) for timer in timers)
        self.armed_in = tuple(frozenset(timer.states) for timer in timers)
        self._restart_on = tuple(frozenset(timer.restart_on) for timer in timers)
        self._hops: dict[tuple[str | None, str], tuple[tuple[int, str], ...]] = {}

    def hop(self, src: str | None, dst: str) -> tuple[tuple[int, str], ...]:
        """``(timer index, LEAVE|ENTER|STAY)`` for every timer a move ``src -> dst``
        touches (``src`` None: the transfer is created in ``dst``)."""
        key = (src, dst)
        ops = self._hops.get(key)
        if ops is None:
            found = []
            for index, states in enumerate(self.armed_in):
                if dst not in states:
                    if src in states:
                        found.append((index, LEAVE))
                elif src not in states:
                    found.append((index, ENTER))
                else:
                    found.append((index, STAY))  # armed again only if it fired meanwhile
            ops = self._hops[key] = tuple(found)
        return ops

    def restarts(self, kind: str, state: str) -> tuple[tuple[int, float], ...]:
        """``(timer index, duration)`` of the timers an applied ``kind`` pushes back while
        the transfer is in ``state``."""
        return tuple(
            (i, self.durations[i])
            for i, (states, kinds) in enumerate(zip(self.armed_in, self._restart_on))
            if state in states and kind in kinds
        )


class DeadlineHeap:
    """Deadlines of every armed timer, earliest first; thread-safe.

    An entry is ``(deadline, sequence, record, timer index)``. Restarting a timer only
    moves the record's slot later; the old entry stays and is re-pushed when it comes
    due, so every armed slot always has an entry no later than its deadline. Entries of
    disarmed slots and retired records are dropped by compaction, which keeps the heap
    within twice the number of armed timers (and at least ``compaction_threshold``).
    """

    def __init__(self, compaction_threshold: int = 4096):
        if compaction_threshold < 1:
            raise ValueError(f"compaction_threshold must be >= 1, got {compaction_threshold}")
        self._heap: list[tuple[float, int, Any, int]] = []
        self._lock = threading.Lock()
        self._seq = itertools.count()
        self._threshold = compaction_threshold
        self._compact_at = compaction_threshold
        self.compactions = 0

    def push(self, deadline: float, record: Any, index: int) -> None:
        with self._lock:
            heapq.heappush(self._heap, (deadline, next(self._seq), record, index))
            if len(self._heap) > self._compact_at:
                self._compact()

    def pop_due(self, now: float) -> tuple[float, Any, int] | None:
        """The earliest entry if its deadline is <= ``now``, removed; else None."""
        with self._lock:
            if not self._heap or self._heap[0][0] > now:
                return None
            deadline, _, record, index = heapq.heappop(self._heap)
            return deadline, record, index

    def earliest(self) -> float | None:
        with self._lock:
            return self._heap[0][0] if self._heap else None

    def __len__(self) -> int:
        return len(self._heap)

    def entries_for(self) -> dict[tuple[int, int], float]:
        """``{(id(record), index): earliest deadline}`` of every entry (for audits)."""
        with self._lock:
            found: dict[tuple[int, int], float] = {}
            for deadline, _, record, index in self._heap:
                key = (id(record), index)
                if key not in found or deadline < found[key]:
                    found[key] = deadline
            return found

    def compact(self) -> None:
        with self._lock:
            self._compact()

    def _compact(self) -> None:
        # Lock held. Reading another shard's record without its lock is safe under the
        # GIL: a slot is cleared only when its timer is disarmed, fired or retired, and
        # re-arming always pushes a new entry (which waits for this lock).
        kept = [entry for entry in self._heap if entry[2].deadlines[entry[3]] is not None]
        heapq.heapify(kept)
        self._heap = kept
        self._compact_at = max(self._threshold, 2 * len(kept))
        self.compactions += 1


#: Times are seconds on a monotonic clock; anything past this is not a clock reading
#: (and would overflow float arithmetic on deadlines).
MAX_TIME = 1e15


def is_time(value: Any) -> bool:
    """Whether ``value`` can be a clock reading: an int or float (not a bool, not another
    number type), finite, within +-MAX_TIME seconds."""
    return (type(value) is float or type(value) is int) and -MAX_TIME < value < MAX_TIME


def check_time(now: Any, what: str) -> float:
    """``now`` as a clock reading, or ``ValueError`` naming ``what``."""
    if not is_time(now):
        raise ValueError(
            f"{what} must be a finite number of seconds (an int or float within "
            f"+-{MAX_TIME:g}), got {now!r}"
        )
    return now

"""TransferTable: creates, finds, dispatches to and retires transfers. Sans-I/O.

The table is this file (construction, recorders, what a step hands back: timers by its
hops, retirement, eventless follow-ups, check mode) and three parts of its own: the
dispatch function (``dispatch.py``), the checks before a step (``admission.py``) and
the timers' driving (``timer_driving.py``).

Rules of the table:
- ``dispatch(event)`` returns ``Result(outcome, state, effects, hops)``; it performs no
  I/O, reads no clock (time comes in the event) and starts no thread.
- A malformed event (an id that is not a string, a time that is not a finite number,
  data that is not a mapping, a peer's payload missing a declared field) is REJECTED
  and counted before anything else; it never raises and never fires a timer.
- Only a local event declared ``creates`` starts a transfer. A peer's message for an
  unknown transfer waits in a bounded, fair, time-limited buffer (``early_facts.py``) and is
  applied when the local side creates the transfer; it never creates one itself.
- A transfer is bound to the peers its creating event's ``source`` names (a comma-separated
  list of senders, ``"?"`` for the first peer it hears from, ``""`` for anyone): a peer's
  fact from any other sender is FORGED, counted, and changes nothing, whether it arrives
  live or was held before the transfer existed.
- A transfer that reached a final state is retired and remembered in a bounded
  per-shard record of ended ids: events for it are LATE. Because peers cannot create
  transfers, even an id that fell out of that record can never come back to life.
  Reaching a final state the spec marks ``anomaly`` is counted and logged.
- A step is atomic: when a binding raises, the record is restored and nothing else
  (timers, counters, buffers) changed. A recorder that raises never loses a step: its
  errors are counted and logged and the result is returned.
- A recorder is a callable ``recorder(event, result)``, or a *step recorder*: an object
  with ``bind_table(table)`` returning ``record(event, before, result, rows)``, which
  also learns the state before the step and the spec rows it ran (the table then runs
  the trace-mode steps, ``codegen.py``). With no recorder the dispatch path is the
  plain one: tracing off costs nothing.
- Every event is counted once, under its final fate: a held fact counts as buffered
  while held and moves to its outcome (or to dropped) when it leaves the buffer.
- Transfers live in shards, each with its own lock, held only while one step runs
  (and the recorder, which must be quick); callers execute the returned effects with no
  lock held. Timers live in one ``DeadlineHeap`` (``timers.py``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from .admission import FIRST_SENDER, NO_EFFECTS, Admission
from .bindings import effect_problem
from .codegen import generate_steps
from .dispatch import make_dispatch
from .early_facts import EarlyFacts
from .errors import InvariantViolation, TransitionError
from .events import Event, Outcome, Result
from .machine import Machine
from .recording import Recorder, StepRecord, StepRecorder
from .reference import ReferenceSteps
from .shard import Shard
from .timer_driving import TimerDriving
from .timers import ENTER, LEAVE, MAX_TIME, DeadlineHeap, TimerPlan, check_time

__all__ = [
    "EXECUTORS",
    "FIRST_SENDER",
    "Recorder",
    "Result",
    "StepRecord",
    "StepRecorder",
    "TransferTable",
]

log = logging.getLogger("moriio_fsm.runtime")

_REJECTED = Outcome.REJECTED
_NO_EFFECTS = NO_EFFECTS

EXECUTORS = ("compiled", "transitions")


class TransferTable(Admission, TimerDriving):
    """All live transfers of one machine kind, and the rules for unknown and ended ones.

    ``machine`` is a ``Machine``. ``executor`` is ``"compiled"`` (generated steps, the hot
    path) or ``"transitions"`` (pytransitions, the reference semantics).
    ``check_invariants`` runs the same steps with every binding checked against its
    declarations and every spec invariant evaluated after every step; a violation raises
    ``InvariantViolation`` and the step is rolled back. ``recorder(event, result)`` is
    called once per dispatched or fired event, under the transfer's shard lock, so per
    transfer it sees events in the order applied; it must be quick and must not dispatch.
    A step recorder (an object with ``bind_table``, see the rules above) also sees the
    state before each step, the rows it took and the steps that raised.
    """

    def __init__(
        self,
        machine: Machine,
        *,
        executor: str = "compiled",
        shards: int = 1,
        ended_capacity: int = 65536,
        pending_capacity: int = 4096,
        pending_per_transfer: int = 8,
        pending_per_source: int | None = None,
        pending_ttl_s: float = 30.0,
        check_invariants: bool = False,
        recorder: Recorder | StepRecorder | None = None,
        timer_compaction_threshold: int = 4096,
    ):
        _check_options(
            executor,
            shards,
            ended_capacity=ended_capacity,
            pending_capacity=pending_capacity,
            pending_per_transfer=pending_per_transfer,
            timer_compaction_threshold=timer_compaction_threshold,
        )
        check_time(pending_ttl_s, "pending_ttl_s")
        if pending_ttl_s <= 0:
            raise ValueError(f"pending_ttl_s must be > 0, got {pending_ttl_s!r}")
        self.machine = machine
        self.spec = spec = machine.spec
        self.executor = executor
        #: What the table was built with (a trace carries it, so a replay builds the same).
        self.options = {
            "shards": shards,
            "ended_capacity": ended_capacity,
            "pending_capacity": pending_capacity,
            "pending_per_transfer": pending_per_transfer,
            "pending_per_source": pending_per_source,
            "pending_ttl_s": pending_ttl_s,
            "check_invariants": check_invariants,
            "timer_compaction_threshold": timer_compaction_threshold,
        }
        per_shard = max(1, pending_capacity // shards)
        per_source = (
            max(1, per_shard // 4)
            if pending_per_source is None
            else max(1, pending_per_source // shards)
        )
        self._shards = tuple(
            Shard(EarlyFacts(per_shard, pending_per_transfer, per_source, pending_ttl_s))
            for _ in range(shards)
        )
        self._mask = shards - 1
        self._ended_cap = max(1, ended_capacity // shards)
        self._check = check_invariants
        self.recorder_errors = 0
        self._errors_lock = threading.Lock()
        self._recording: int | None = None  # the thread running the recorder
        self._creators = frozenset(n for n, e in spec.events.items() if e.creates)
        self._remote_payloads = {
            n: tuple(e.payload.items()) for n, e in spec.events.items() if e.origin == "remote"
        }
        self._final = machine.final
        self._anomaly = machine.anomaly
        self._plan = TimerPlan(spec, machine.config)
        self._timer_events = tuple(machine.event_classes[kind] for kind in self._plan.events)
        self._initial_timers = tuple(
            index for index, op in self._plan.hop(None, spec.initial) if op == ENTER
        )
        self._no_deadlines = (None,) * len(self._plan.events)
        self._heap = DeadlineHeap(timer_compaction_threshold)
        self._max_hops = len(spec.states) + 1
        self._declared_after = machine.declared_after() if check_invariants else {}
        self._plain = self._make_steps(trace=False)
        self._traced: tuple | None = None  # trace-mode steps, made when first needed
        self.recorder = recorder  # installs the steps and the dispatch function

    # -- public API -------------------------------------------------------------------

    def dispatch(self, ev: Event) -> Result:
        """Apply one event. Never raises for late, duplicate, unknown, malformed or
        unexpected events: those are outcomes. Raises ``TransitionError`` only for a bug
        in a binding and ``InvariantViolation`` only when invariant checking is on; the
        transfer is then exactly as it was before the event.

        (Each table replaces this method by the dispatch variant of its shards and
        recorder, ``dispatch.py``, whenever its recorder is set.)"""
        return self._make_dispatch()(ev)

    @property
    def recorder(self) -> Recorder | StepRecorder | None:
        return self._recorder

    @recorder.setter
    def recorder(self, recorder: Recorder | StepRecorder | None) -> None:
        bind = getattr(recorder, "bind_table", None)
        step_record = bind(self) if bind is not None else None
        if step_record is not None and self.executor == "compiled":
            if self._traced is None:
                self._traced = self._make_steps(trace=True)
            installed = self._traced
        else:
            installed = self._plain
        self._steps, self._creating_steps, self.generated = installed
        self._step_record: StepRecord | None = step_record
        self._recorder = recorder
        # Each table installs its own dispatch function over the method, on purpose.
        self.dispatch = self._make_dispatch()  # type: ignore[method-assign, assignment]

    def _make_steps(self, *, trace: bool) -> tuple:
        """``(steps, creating steps, generated module or None)`` of the table's executor.
        Trace mode (compiled only) is the same module plus a note of every row taken; its
        settle is ``_settle_traced``, bound to the trace-mode eventless functions, so a
        step of either mode never calls the other's."""
        verify = self._verify if self._check else None
        if self.executor == "compiled":
            generated = generate_steps(
                self.machine,
                self._plan,
                result_cls=Result,
                finish=self._finish,
                arm=self._arm,
                settle=self._settle_traced if trace else self._settle,
                verify=verify,
                no_effects=_NO_EFFECTS,
                trace=trace,
            )
            if trace:
                self._fire_eventless_traced = generated.eventless
            else:
                self._fire_eventless = generated.eventless
            steps = generated.steps
        else:
            generated = None
            self._fire_eventless = {}
            steps = ReferenceSteps(
                self.machine,
                result_cls=Result,
                finish=self._finish,
                verify=verify,
                no_effects=_NO_EFFECTS,
            ).steps
        return steps, self._guard_special_kinds(steps), generated

    def _make_dispatch(self) -> Callable[[Event], Result]:
        """The dispatch variant of this table's shards and recorder (``dispatch.py``),
        with everything it touches bound once."""
        only = self._shards[0]
        bindings = {
            "malformed": self._malformed,
            "low": -MAX_TIME,
            "high": MAX_TIME,
            "absent": self._dispatch_absent,
            "steps": self._steps,
            "rejected_in": {
                state: Result(_REJECTED, state, _NO_EFFECTS) for state in self.spec.states
            },
            "Result": Result,
            "REJECTED": _REJECTED,
            "REJECTED_INDEX": _REJECTED.index,
            "NO_EFFECTS": _NO_EFFECTS,
            "shard": only,
            "acquire": only.lock.acquire,
            "release": only.lock.release,
            "live_get": only.live.get,
            "shards": self._shards,
            "mask": self._mask,
            "refuse_reentry": self._refuse_reentry,
            "record": self._record,
            # The transitions executor does not say which rows ran: its steps leave None.
            "no_rows": () if self.executor == "compiled" else None,
            "record_step": self._step_record,
            "record_raised": self._record_step,
            "recorder_failed": self._recorder_failed,
            "TransitionError": TransitionError,
            "InvariantViolation": InvariantViolation,
        }
        recording = (
            "steps"
            if self._step_record is not None
            else "results"
            if self._recorder is not None
            else "none"
        )
        return make_dispatch(
            bindings, sharding="one" if len(self._shards) == 1 else "many", recording=recording
        )

    def get(self, transfer_id: str):
        """The live record of ``transfer_id`` or None. Read it only for inspection."""
        return self._shards[hash(transfer_id) & self._mask].live.get(transfer_id)

    def state_of(self, transfer_id: str) -> str | None:
        """The live state, the final state if remembered as ended, else None."""
        shard = self._shards[hash(transfer_id) & self._mask]
        with shard.lock:
            tx = shard.live.get(transfer_id)
            if tx is not None:
                return tx.state
            return shard.ended.get(transfer_id)

    def live_ids(self) -> list[str]:
        """Ids of every live transfer (a snapshot)."""
        ids: list[str] = []
        for shard in self._shards:
            with shard.lock:
                ids.extend(shard.live)
        return ids

    def __len__(self) -> int:
        return sum(len(s.live) for s in self._shards)

    def stats(self) -> dict[str, Any]:
        """Counters of every outcome (each event once, by its final fate), transfers
        ended per final state and in anomaly states, and live, ended, pending and timer
        sizes."""
        counts = [0] * len(Outcome)
        ended_in: dict[str, int] = {}
        for s in self._shards:
            with s.lock:
                for index, n in enumerate(s.counts):
                    counts[index] += n
                for state, n in s.ended_in.items():
                    ended_in[state] = ended_in.get(state, 0) + n
        return {
            "outcomes": {o.value: counts[o.index] for o in Outcome},
            "ended": ended_in,
            "anomalies": sum(n for state, n in ended_in.items() if state in self._anomaly),
            "live": len(self),
            "ended_remembered": sum(len(s.ended) for s in self._shards),
            "pending_events": sum(len(s.early) for s in self._shards),
            "timer_entries": len(self._heap),
            "recorder_errors": self.recorder_errors,
        }

    # -- internals (shard lock held) ---------------------------------------------------

    def _malformed(self) -> Result:
        # Counted on shard 0: the id may not even be hashable, so no shard owns it.
        shard = self._shards[0]
        with shard.lock:
            shard.counts[_REJECTED.index] += 1
        return Result(_REJECTED, None, _NO_EFFECTS)

    def _refuse_reentry(self) -> None:
        if self._recording == threading.get_ident():
            raise RuntimeError(
                f"{self.spec.name}: the recorder dispatched an event; a recorder "
                "runs under the shard lock and must not dispatch (it would hang)"
            )

    def _record_step(self, ev: Event, before, result, rows, *error) -> None:
        try:
            record = self._step_record
            assert record is not None, "called only while a step recorder is set"
            record(ev, before, result, rows, *error)
        except Exception as exc:
            self._recorder_failed(ev, exc)

    def _record(self, ev: Event, result: Result) -> None:
        self._recording = threading.get_ident()
        try:
            recorder = self._recorder
            assert callable(recorder), "called only while a recorder of results is set"
            recorder(ev, result)
        except Exception as exc:  # the step stands; a broken recorder is reported
            self._recorder_failed(ev, exc)
        finally:
            self._recording = None

    def _recorder_failed(self, ev: Event, exc: Exception) -> None:
        with self._errors_lock:
            self.recorder_errors += 1
        if self.recorder_errors <= 10 or self.recorder_errors % 1000 == 0:
            log.error(
                "trace recorder failed (%d so far) on event %r of transfer %r: %s: %s",
                self.recorder_errors,
                ev.kind,
                ev.transfer_id,
                type(exc).__name__,
                exc,
            )

    def _settle(self, tx, ev: Event, out: list, hops: list) -> None:
        """Run eventless rows until none fires (bounded: the validator refuses cycles)."""
        fire_eventless = self._fire_eventless
        for _ in range(self._max_hops):
            here = tx.state
            fire = fire_eventless.get(here)
            if fire is None or not fire(tx, ev, out):
                return
            hops.append((here, tx.state))
        raise TransitionError(
            f"{self.spec.name}: eventless rows did not settle for transfer {tx.transfer_id!r}",
            transfer_id=tx.transfer_id,
            event=ev.kind,
        )

    def _settle_traced(self, tx, ev: Event, out: list, hops: list, shard: Shard) -> None:
        """``_settle`` for trace-mode steps: the eventless function returns the row it
        took (+ 1), noted in ``shard.fired``."""
        fire_eventless = self._fire_eventless_traced
        for _ in range(self._max_hops):
            here = tx.state
            fire = fire_eventless.get(here)
            if fire is None:
                return
            taken = fire(tx, ev, out)
            if not taken:
                return
            assert shard.fired is not None, "trace-mode steps start with a tuple"
            shard.fired += (taken - 1,)
            hops.append((here, tx.state))
        raise TransitionError(
            f"{self.spec.name}: eventless rows did not settle for transfer {tx.transfer_id!r}",
            transfer_id=tx.transfer_id,
            event=ev.kind,
        )

    def _verify(self, tx, ev: Event, row_index: int, before: dict, out) -> None:
        """Check mode, after row ``row_index`` ran (and the eventless rows it led to):
        every invariant holds, only declared fields changed, every effect is declared
        with exactly its declared fields and types. Raises ``InvariantViolation``; the
        step is then rolled back."""
        broken = self.machine.broken_invariant(tx)
        if broken is not None:
            name, why = broken
            raise InvariantViolation(
                f"{self.spec.name}: invariant {name!r} {why} for transfer {tx.transfer_id!r} in "
                f"state {tx.state!r} after event {ev.kind!r} (the step was rolled back): {tx!r}"
            )
        writes, emits = self._declared_after[row_index]
        changed = sorted(
            f for f, old in before.items() if getattr(tx, f) is not old and getattr(tx, f) != old
        )
        undeclared = [f for f in changed if f not in writes]
        if undeclared:
            raise InvariantViolation(
                f"{self.spec.name}: transition #{row_index} changed {', '.join(undeclared)} of "
                f"transfer {tx.transfer_id!r}, which none of its actions (nor the eventless rows "
                "it can lead to) declares under writes; the step was rolled back"
            )
        for effect in out:
            problem = effect_problem(self.spec, effect, emits)
            if problem:
                raise InvariantViolation(
                    f"{self.spec.name}: transition #{row_index} {problem} "
                    f"(transfer {tx.transfer_id!r}); the step was rolled back"
                )

    def _finish(self, shard: Shard, tx, ev: Event, outcome: Outcome, hops: list, out) -> Result:
        """The tail of an applied step that changed state (or may have): timers by the
        hops, retirement when final, the outcome counted."""
        deadlines = tx.deadlines
        plan = self._plan
        now = ev.time
        for src, dst in hops:
            for index, op in plan.hop(src, dst):
                if op == LEAVE:
                    deadlines[index] = None
                elif op == ENTER or deadlines[index] is None:
                    self._arm(tx, index, now)
        state = tx.state
        for index, duration in plan.restarts(ev.kind, state):
            deadline = deadlines[index]
            if deadline is None or now + duration < deadline:
                self._arm(tx, index, now)  # a deadline never moves before its heap entry
            else:
                deadlines[index] = now + duration
        if state in self._final:
            self._retire(shard, tx)
        shard.counts[outcome.index] += 1
        return Result(outcome, state, out or _NO_EFFECTS, tuple(hops) if hops else None)

    def _retire(self, shard: Shard, tx) -> None:
        shard.live.pop(tx.transfer_id, None)
        tx.deadlines[:] = self._no_deadlines
        state = tx.state
        shard.ended_in[state] = shard.ended_in.get(state, 0) + 1
        if state in self._anomaly:
            try:
                log.warning(
                    "%s: transfer %r ended in anomaly state %r: %r",
                    self.spec.name,
                    tx.transfer_id,
                    state,
                    tx,
                )
            except Exception:  # a broken log handler must not undo a retirement
                pass
        ended = shard.ended
        ended[tx.transfer_id] = state
        if len(ended) > self._ended_cap:
            del ended[next(iter(ended))]


def _check_options(executor: str, shards: int, **limits: int) -> None:
    """``ValueError`` naming the first option that is not what a table can be built with."""
    if executor not in EXECUTORS:
        raise ValueError(f"unknown executor {executor!r}; expected one of {', '.join(EXECUTORS)}")
    if type(shards) is not int or shards < 1 or shards & (shards - 1):
        raise ValueError(f"shards must be a power of two >= 1, got {shards!r}")
    for name, value in limits.items():
        if type(value) is not int or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")

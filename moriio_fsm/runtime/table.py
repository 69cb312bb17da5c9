"""TransferTable: creates, finds, dispatches to and retires transfers. Sans-I/O.

Rules of this file:
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

import functools
import logging
import threading
from typing import Any, Callable, Sequence

import msgspec

from ..lang.model import value_fits
from .bindings import effect_problem
from .codegen import generate_steps
from .errors import InvariantViolation, TimerStepsFailed, TransitionError
from .events import Effect, Event, Outcome
from .machine import Machine
from .early_facts import EarlyFacts, sender_of
from .reference import ReferenceSteps
from .timers import ENTER, LEAVE, MAX_TIME, DeadlineHeap, TimerPlan, check_time

log = logging.getLogger("moriio_fsm.runtime")

_APPLIED = Outcome.APPLIED
_REJECTED = Outcome.REJECTED
_NO_EFFECTS: tuple = ()

EXECUTORS = ("compiled", "transitions")


class Result(msgspec.Struct, frozen=True, gc=False):
    """What one dispatch did: the outcome, the transfer's state after it, the effects.

    ``state`` is None when no transfer exists for the event (unknown, buffered,
    dropped, rejected before creation). ``hops`` lists the ``(from, to)`` state
    changes in order, eventless follow-ups included, or is None when the state did not
    change. Fields are read by name: a result does not unpack (four fields read as three
    would hide which one was left out).
    """

    outcome: Outcome
    state: str | None
    effects: Sequence[Effect]
    hops: tuple[tuple[str, str], ...] | None = None


#: A creating event's ``source`` that binds the transfer to the first peer it hears from.
FIRST_SENDER = "?"

_HELD = Result(Outcome.BUFFERED, None, _NO_EFFECTS)
_DROPPED = Result(Outcome.DROPPED, None, _NO_EFFECTS)
_UNKNOWN = Result(Outcome.UNKNOWN, None, _NO_EFFECTS)


class _Shard:
    __slots__ = ("lock", "live", "ended", "early", "counts", "ended_in", "fired")

    def __init__(self, early: EarlyFacts) -> None:
        self.lock = threading.Lock()
        self.live: dict[str, Any] = {}
        self.ended: dict[str, str] = {}          # insertion-ordered: oldest first
        self.early = early
        self.counts = [0] * len(Outcome)         # indexed by Outcome.index
        self.ended_in: dict[str, int] = {}       # final state -> transfers that ended there
        self.fired: tuple[int, ...] = ()         # trace mode: rows the running step took


Recorder = Callable[[Event, Result], None]
#: What a step recorder's ``bind_table(table)`` returns: called as
#: ``record(event, state_before, result, rows)`` under the shard lock after every step;
#: ``result`` is None when the step raised (``error`` then carries the exception) and
#: ``rows`` is the tuple of spec rows taken (None with the transitions executor).
StepRecord = Callable[..., None]


class TransferTable:
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

    def __init__(self, machine: Machine, *, executor: str = "compiled", shards: int = 1,
                 ended_capacity: int = 65536, pending_capacity: int = 4096,
                 pending_per_transfer: int = 8, pending_per_source: int | None = None,
                 pending_ttl_s: float = 30.0, check_invariants: bool = False,
                 recorder: Recorder | None = None, timer_compaction_threshold: int = 4096):
        if executor not in EXECUTORS:
            raise ValueError(f"unknown executor {executor!r}; expected one of {', '.join(EXECUTORS)}")
        if type(shards) is not int or shards < 1 or shards & (shards - 1):
            raise ValueError(f"shards must be a power of two >= 1, got {shards!r}")
        for name, value in (("ended_capacity", ended_capacity), ("pending_capacity", pending_capacity),
                            ("pending_per_transfer", pending_per_transfer),
                            ("timer_compaction_threshold", timer_compaction_threshold)):
            if type(value) is not int or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        check_time(pending_ttl_s, "pending_ttl_s")
        if pending_ttl_s <= 0:
            raise ValueError(f"pending_ttl_s must be > 0, got {pending_ttl_s!r}")
        self.machine = machine
        self.spec = spec = machine.spec
        self.executor = executor
        #: What the table was built with (a trace carries it, so a replay builds the same).
        self.options = {"shards": shards, "ended_capacity": ended_capacity,
                        "pending_capacity": pending_capacity,
                        "pending_per_transfer": pending_per_transfer,
                        "pending_per_source": pending_per_source, "pending_ttl_s": pending_ttl_s,
                        "check_invariants": check_invariants,
                        "timer_compaction_threshold": timer_compaction_threshold}
        per_shard = max(1, pending_capacity // shards)
        per_source = (max(1, per_shard // 4) if pending_per_source is None
                      else max(1, pending_per_source // shards))
        self._shards = tuple(_Shard(EarlyFacts(per_shard, pending_per_transfer, per_source,
                                               pending_ttl_s)) for _ in range(shards))
        self._mask = shards - 1
        self._ended_cap = max(1, ended_capacity // shards)
        self._check = check_invariants
        self.recorder_errors = 0
        self._errors_lock = threading.Lock()
        self._recording: int | None = None         # the thread running the recorder
        self._creators = frozenset(n for n, e in spec.events.items() if e.creates)
        self._remote_payloads = {n: tuple(e.payload.items())
                                 for n, e in spec.events.items() if e.origin == "remote"}
        self._final = machine.final
        self._anomaly = machine.anomaly
        self._plan = TimerPlan(spec, machine.config)
        self._timer_events = tuple(machine.event_classes[kind] for kind in self._plan.events)
        self._initial_timers = tuple(index for index, op in self._plan.hop(None, spec.initial)
                                     if op == ENTER)
        self._no_deadlines = (None,) * len(self._plan.events)
        self._heap = DeadlineHeap(timer_compaction_threshold)
        self._max_hops = len(spec.states) + 1
        verify = self._verify if check_invariants else None
        self._declared_after = machine.declared_after() if check_invariants else {}
        if executor == "compiled":
            generated = generate_steps(machine, self._plan, result_cls=Result, finish=self._finish,
                                       arm=self._arm, settle=self._settle, verify=verify,
                                       no_effects=_NO_EFFECTS)
            self._fire_eventless = generated.eventless
            self.generated = generated
            self._steps = generated.steps
        else:
            self.generated = None
            self._fire_eventless = {}
            self._steps = ReferenceSteps(machine, result_cls=Result, finish=self._finish,
                                         verify=verify, no_effects=_NO_EFFECTS).steps
        self._creating_steps = self._guard_special_kinds(self._steps)
        self._plain = (self._steps, self._creating_steps, self.generated)
        self._traced: tuple | None = None           # trace-mode steps, made when first needed
        self._step_record: StepRecord | None = None
        self.recorder = recorder        # builds the dispatch function

    # -- public API -------------------------------------------------------------------

    def dispatch(self, ev: Event) -> Result:
        """Apply one event. Never raises for late, duplicate, unknown, malformed or
        unexpected events: those are outcomes. Raises ``TransitionError`` only for a bug
        in a binding and ``InvariantViolation`` only when invariant checking is on; the
        transfer is then exactly as it was before the event.

        (Each table replaces this method by a closure built for it, ``_make_dispatch``.)"""
        return self._make_dispatch()(ev)

    @property
    def recorder(self) -> Recorder | None:
        return self._recorder

    @recorder.setter
    def recorder(self, recorder: Recorder | None) -> None:
        bind = getattr(recorder, "bind_table", None)
        step_record = bind(self) if bind is not None else None
        if step_record is not None and self.executor == "compiled":
            if self._traced is None:
                self._traced = self._make_traced_steps()
            installed = self._traced
        else:
            installed = self._plain
        self._steps, self._creating_steps, self.generated = installed
        self._step_record = step_record
        self._recorder = recorder
        self.dispatch = self._make_dispatch()

    def _make_traced_steps(self) -> tuple:
        """The trace-mode steps: the same module plus a note of every row taken. Its
        settle is ``_settle_traced``, bound to the trace-mode eventless functions, so a
        step of either mode never calls the other's."""
        generated = generate_steps(self.machine, self._plan, result_cls=Result, finish=self._finish,
                                   arm=self._arm, settle=self._settle_traced,
                                   verify=self._verify if self._check else None,
                                   no_effects=_NO_EFFECTS, trace=True)
        self._fire_eventless_traced = generated.eventless
        steps = generated.steps
        return steps, self._guard_special_kinds(steps), generated

    def _make_dispatch(self) -> Callable[[Event], Result]:
        """The dispatch function, with everything it touches bound as locals: it runs
        once per layer per transfer, where every attribute lookup shows. Events of the
        kinds that need checks first (creating, timer, peer) reach their step through
        the wrappers ``_guard_special_kinds`` put in the step table."""
        if self._step_record is not None:
            return self._make_traced_dispatch()
        shards, mask, steps = self._shards, self._mask, self._steps
        absent, malformed = self._dispatch_absent, self._malformed
        record = self._record if self._recorder is not None else None
        rejected_in = {state: Result(_REJECTED, state, _NO_EFFECTS) for state in self.spec.states}
        rejected_index = _REJECTED.index
        low, high = -MAX_TIME, MAX_TIME

        def run(shard, ev, tx):
            """The part under the shard lock, shared by both dispatch variants."""
            if tx is None:
                result = absent(shard, ev)
            else:
                step = steps[tx.state].get(ev.kind)
                if step is None:
                    shard.counts[rejected_index] += 1
                    result = rejected_in[tx.state]
                else:
                    result = step(shard, tx, ev)    # counts its own outcome
            if record is not None:
                record(ev, result)
            return result

        def ill_formed(shard, tx) -> Result:
            # An unhashable id or source: nothing changed, since steps turn their own
            # errors into TransitionError before they reach this point.
            shard.counts[rejected_index] += 1
            return Result(_REJECTED, None if tx is None else tx.state, _NO_EFFECTS)

        if len(shards) == 1:
            # One shard (the default): its lock and dict are bound once, no id is hashed.
            only = shards[0]
            acquire, release, live_get = only.lock.acquire, only.lock.release, only.live.get

            def dispatch(ev: Event) -> Result:
                try:
                    time = ev.time
                    tid = ev.transfer_id
                except AttributeError:                # not an event at all
                    return malformed()
                kind = time.__class__
                if ((kind is not float and kind is not int) or not low < time < high
                        or tid.__class__ is not str):   # NaN, infinite, huge, a non-str id
                    return malformed()
                acquire()
                tx = live_get(tid)                    # a str key: this cannot raise
                try:
                    if tx is None:
                        return absent(only, ev)
                    step = steps[tx.state].get(ev.kind)
                    if step is None:
                        only.counts[rejected_index] += 1
                        return rejected_in[tx.state]
                    return step(only, tx, ev)    # counts its own outcome
                except TypeError:
                    return ill_formed(only, tx)
                finally:
                    release()

            if record is None:
                return dispatch

            def recorded_dispatch(ev: Event) -> Result:
                # The recorder runs under the lock, so per transfer it sees steps in order.
                try:
                    time = ev.time
                    if ((time.__class__ is not float and time.__class__ is not int)
                            or not -MAX_TIME < time < MAX_TIME or ev.transfer_id.__class__ is not str):
                        return malformed()
                except AttributeError:
                    return malformed()
                self._refuse_reentry()
                acquire()
                try:
                    result = run(only, ev, live_get(ev.transfer_id))
                except TypeError:
                    result = ill_formed(only, None)
                finally:
                    release()
                return result

            return recorded_dispatch

        def dispatch(ev: Event) -> Result:
            try:
                time = ev.time
                if ((time.__class__ is not float and time.__class__ is not int)
                        or not -MAX_TIME < time < MAX_TIME or ev.transfer_id.__class__ is not str):
                    return malformed()
                shard = shards[hash(ev.transfer_id) & mask]
            except AttributeError:                # not an event at all
                return malformed()
            if record is not None:
                self._refuse_reentry()
            tx = None
            lock = shard.lock
            lock.acquire()
            try:
                tx = shard.live.get(ev.transfer_id)
                result = run(shard, ev, tx)
            except TypeError:
                result = ill_formed(shard, tx)
            finally:
                lock.release()
            return result

        return dispatch

    def _make_traced_dispatch(self) -> Callable[[Event], Result]:
        """Dispatch with a step recorder: the same checks and steps (trace mode), plus
        the state before, the rows taken and the steps that raised, handed to the
        recorder under the shard lock. Only built when a step recorder is set."""
        shards, mask, steps = self._shards, self._mask, self._steps
        absent, malformed = self._dispatch_absent, self._malformed
        record = self._step_record
        # The transitions executor does not say which rows ran: its steps leave None.
        no_rows = () if self.executor == "compiled" else None
        rejected_in = {state: Result(_REJECTED, state, _NO_EFFECTS) for state in self.spec.states}
        rejected_index = _REJECTED.index
        low, high = -MAX_TIME, MAX_TIME
        failed = self._step_recorder_failed

        def step_and_record(shard: _Shard, ev: Event, tid: str) -> Result:
            """Under the shard's lock: the step, then its record."""
            tx = shard.live.get(tid)
            before = None if tx is None else tx.state
            shard.fired = no_rows
            try:
                if tx is None:
                    result = absent(shard, ev)
                else:
                    step = steps[before].get(ev.kind)
                    if step is None:
                        shard.counts[rejected_index] += 1
                        result = rejected_in[before]
                    else:
                        result = step(shard, tx, ev)    # counts its own outcome
            except (TransitionError, InvariantViolation) as exc:
                # Rolled back and raised to the caller; the trace keeps the attempt.
                try:
                    record(ev, before, None, shard.fired, exc)
                except Exception as rec_exc:
                    failed(ev, rec_exc)
                raise
            except TypeError:
                # An unhashable source: nothing changed (steps turn their own errors into
                # TransitionError before this point).
                shard.counts[rejected_index] += 1
                return Result(_REJECTED, before, _NO_EFFECTS)
            try:
                record(ev, before, result, shard.fired)
            except Exception as exc:       # the step stands; a broken recorder is reported
                failed(ev, exc)
            return result

        if len(shards) == 1:
            # One shard: the body of step_and_record is written out here, since a call
            # per event shows in the recorder's cost.
            only = shards[0]
            acquire, release, live_get = only.lock.acquire, only.lock.release, only.live.get
            counts = only.counts

            def traced_dispatch(ev: Event) -> Result:
                try:
                    time = ev.time
                    tid = ev.transfer_id
                except AttributeError:                # not an event at all
                    return malformed()
                kind = time.__class__
                if ((kind is not float and kind is not int) or not low < time < high
                        or tid.__class__ is not str):   # NaN, infinite, huge, a non-str id
                    return malformed()
                acquire()
                try:
                    tx = live_get(tid)
                    if tx is None:
                        before = None
                        only.fired = no_rows
                        result = absent(only, ev)
                    else:
                        before = tx.state
                        only.fired = no_rows
                        step = steps[before].get(ev.kind)
                        if step is None:
                            counts[rejected_index] += 1
                            result = rejected_in[before]
                        else:
                            result = step(only, tx, ev)    # counts its own outcome
                except (TransitionError, InvariantViolation) as exc:
                    try:
                        record(ev, before, None, only.fired, exc)
                    except Exception as rec_exc:
                        failed(ev, rec_exc)
                    release()
                    raise
                except TypeError:
                    counts[rejected_index] += 1
                    release()
                    return Result(_REJECTED, None if tx is None else tx.state, _NO_EFFECTS)
                except BaseException:
                    release()
                    raise
                try:
                    record(ev, before, result, only.fired)
                except Exception as exc:       # the step stands; a broken recorder is reported
                    failed(ev, exc)
                finally:
                    release()
                return result

            return traced_dispatch

        def traced_dispatch_sharded(ev: Event) -> Result:
            try:
                time = ev.time
                tid = ev.transfer_id
            except AttributeError:
                return malformed()
            kind = time.__class__
            if ((kind is not float and kind is not int) or not low < time < high
                    or tid.__class__ is not str):
                return malformed()
            shard = shards[hash(tid) & mask]
            shard.lock.acquire()
            try:
                return step_and_record(shard, ev, tid)
            finally:
                shard.lock.release()

        return traced_dispatch_sharded

    def _step_recorder_failed(self, ev: Event, exc: Exception) -> None:
        with self._errors_lock:
            self.recorder_errors += 1
        if self.recorder_errors <= 10 or self.recorder_errors % 1000 == 0:
            log.error("trace recorder failed (%d so far) on event %r of transfer %r: %s: %s",
                      self.recorder_errors, ev.kind, ev.transfer_id, type(exc).__name__, exc)

    def _guard_special_kinds(self, steps: dict) -> dict:
        """Put a checking wrapper in front of the steps of creating, timer and peer
        events, in every state: a second create is a duplicate, a timer event counts only
        when its deadline is due, a peer's event counts only from the transfer's own peer.
        (Every step checks its event's payload types itself.) Returns the creating steps
        themselves, which ``_create`` runs."""
        initial = steps[self.spec.initial]
        creating_steps = {kind: initial.get(kind) for kind in self._creators}
        for state, by_kind in steps.items():
            for kind in self._creators:
                by_kind[kind] = self._duplicate_create
            for kind, index in self._plan.index_of_event.items():
                by_kind[kind] = functools.partial(self._timer_step, index, by_kind.get(kind))
            for kind in self._remote_payloads:
                by_kind[kind] = functools.partial(self._peer_step, by_kind.get(kind))
        return creating_steps

    def _peer_step(self, step, shard: _Shard, tx, ev: Event) -> Result:
        """A peer's event for a live transfer: taken only from a sender the transfer is
        bound to (any sender when unbound; the first one heard when bound that way)."""
        bound = tx._senders
        if bound is not None:
            source = ev.source
            if source.__class__ is not str:
                shard.counts[_REJECTED.index] += 1
                return Result(_REJECTED, tx.state, _NO_EFFECTS)
            sender = sender_of(ev)
            if bound is not FIRST_SENDER and sender not in bound:
                shard.counts[Outcome.FORGED.index] += 1
                return Result(Outcome.FORGED, tx.state, _NO_EFFECTS)
        if step is None:
            shard.counts[_REJECTED.index] += 1
            return Result(_REJECTED, tx.state, _NO_EFFECTS)
        result = step(shard, tx, ev)
        if bound is FIRST_SENDER and result.outcome is _APPLIED:
            # After the step, and only for a fact the spec took: a step that raised, or a
            # fact it ignored or refused, binds no one.
            tx._senders = frozenset((sender,))
        return result

    def _duplicate_create(self, shard: _Shard, tx, ev: Event) -> Result:
        shard.counts[Outcome.DUPLICATE.index] += 1
        return Result(Outcome.DUPLICATE, tx.state, _NO_EFFECTS)

    def _timer_step(self, index: int, step, shard: _Shard, tx, ev: Event) -> Result:
        deadline = tx.deadlines[index]
        if deadline is None or deadline > ev.time:
            shard.counts[Outcome.IGNORED.index] += 1
            return Result(Outcome.IGNORED, tx.state, _NO_EFFECTS)   # stale or early timer
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
                if current is None or shard.live.get(tx.transfer_id) is not tx:
                    continue                                  # disarmed or retired
                if current > deadline:
                    self._heap.push(current, tx, index)       # restarted since pushed
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
                            problems.append(f"transfer {tx.transfer_id!r} in state {tx.state!r}: "
                                            f"timer {self._plan.names[index]!r} is armed for "
                                            f"{deadline} but the heap holds "
                                            f"{'no entry' if pushed is None else pushed}")
        return problems

    # -- internals (shard lock held) ---------------------------------------------------

    def _malformed(self) -> Result:
        # Counted on shard 0: the id may not even be hashable, so no shard owns it.
        shard = self._shards[0]
        with shard.lock:
            shard.counts[_REJECTED.index] += 1
        return Result(_REJECTED, None, _NO_EFFECTS)

    def _refuse_reentry(self) -> None:
        if self._recording == threading.get_ident():
            raise RuntimeError(f"{self.spec.name}: the recorder dispatched an event; a recorder "
                               "runs under the shard lock and must not dispatch (it would hang)")

    def _record_step(self, ev: Event, before, result, rows, *error) -> None:
        try:
            self._step_record(ev, before, result, rows, *error)
        except Exception as exc:
            self._step_recorder_failed(ev, exc)

    def _record(self, ev: Event, result: Result) -> None:
        self._recording = threading.get_ident()
        try:
            self._recorder(ev, result)
        except Exception as exc:        # the step stands; a broken recorder is reported
            with self._errors_lock:
                self.recorder_errors += 1
            if self.recorder_errors <= 10 or self.recorder_errors % 1000 == 0:
                log.error("trace recorder failed (%d so far) on event %r of transfer %r: %s: %s",
                          self.recorder_errors, ev.kind, ev.transfer_id, type(exc).__name__, exc)
        finally:
            self._recording = None

    def _payload_ok(self, ev: Event) -> bool:
        """Whether a peer's event for a transfer not created yet has its payload of the
        declared types (held facts are checked before they are kept)."""
        for name, type_name in self._remote_payloads.get(ev.kind, ()):
            value = getattr(ev, name, None)
            if type_name == "int":
                if value.__class__ is not int:
                    return False
            elif not value_fits(value, type_name):
                return False
        return True

    def _dispatch_absent(self, shard: _Shard, ev: Event) -> Result:
        tid = ev.transfer_id
        counts = shard.counts
        if tid in shard.ended:
            counts[Outcome.LATE.index] += 1
            return Result(Outcome.LATE, shard.ended[tid], _NO_EFFECTS)
        if ev.kind in self._creators:
            return self._create(shard, ev)
        if ev.kind in self._remote_payloads:
            if not self._payload_ok(ev) or ev.source.__class__ is not str:
                counts[_REJECTED.index] += 1
                return Result(_REJECTED, None, _NO_EFFECTS)
            kept, evicted = shard.early.hold(ev)
            if evicted:
                counts[Outcome.BUFFERED.index] -= evicted
                counts[Outcome.DROPPED.index] += evicted
            if kept:
                counts[Outcome.BUFFERED.index] += 1
                return _HELD
            counts[Outcome.DROPPED.index] += 1
            return _DROPPED
        counts[Outcome.UNKNOWN.index] += 1
        return _UNKNOWN

    def _run_step(self, shard: _Shard, tx, ev: Event) -> Result:
        step = self._steps[tx.state].get(ev.kind)
        if step is None:
            shard.counts[_REJECTED.index] += 1
            return Result(_REJECTED, tx.state, _NO_EFFECTS)
        return step(shard, tx, ev)

    def _create(self, shard: _Shard, ev: Event) -> Result:
        tx = self.machine.record_class(ev.transfer_id)
        step = self._creating_steps.get(ev.kind)
        bound = _bound_senders(ev.source)
        if step is None or bound is _REJECTED:
            shard.counts[_REJECTED.index] += 1
            return Result(_REJECTED, None, _NO_EFFECTS)
        tx._senders = bound
        result = step(shard, tx, ev)
        if result.outcome is not _APPLIED:
            # The spec refused the creating event itself (a guard on its payload): nothing
            # is created, armed or remembered. The step counted it already.
            shard.counts[result.outcome.index] -= 1
            shard.counts[_REJECTED.index] += 1
            return Result(_REJECTED, None, _NO_EFFECTS)
        if not result.hops:
            # Still in the initial state: arm its timers now (a step that left it armed
            # the timers of the states it went through itself).
            for index in self._initial_timers:
                if tx.deadlines[index] is None:
                    self._arm(tx, index, ev.time)
        shard.counts[_APPLIED.index] -= 1
        shard.counts[Outcome.CREATED.index] += 1
        fresh, expired = shard.early.take(ev.transfer_id, ev.time) if len(shard.early) else ((), 0)
        if not fresh and not expired:
            if tx.state not in self._final:     # else: ended in its creating step, retired
                shard.live[ev.transfer_id] = tx
            return Result(Outcome.CREATED, tx.state, result.effects, result.hops)
        effects = list(result.effects)
        hops = list(result.hops or ())
        shard.counts[Outcome.BUFFERED.index] -= len(fresh) + expired
        shard.counts[Outcome.DROPPED.index] += expired
        if tx.state in self._final:            # ended in its creating step: retired already
            shard.counts[Outcome.LATE.index] += len(fresh)
            return Result(Outcome.CREATED, tx.state, effects or _NO_EFFECTS, tuple(hops) or None)
        shard.live[ev.transfer_id] = tx
        for held in fresh:
            if shard.live.get(ev.transfer_id) is not tx:
                shard.counts[Outcome.LATE.index] += 1     # an earlier held fact ended it
                continue
            try:
                held_result = self._run_step(shard, tx, held)
                if held_result.outcome is Outcome.FORGED:
                    log.warning("%s: a %s held for %r came from %r, not from the peer the "
                                "transfer is bound to; refused", self.spec.name, held.kind,
                                ev.transfer_id, sender_of(held))
            except TransitionError as exc:
                # The transfer was created; a held fact whose step broke was rolled back
                # and counts as rejected. Its error is a binding's bug: say so loudly.
                shard.counts[_REJECTED.index] += 1
                log.error("%s: a held %s for %r could not be applied at creation: %s",
                          self.spec.name, held.kind, ev.transfer_id, exc)
                continue
            effects.extend(held_result.effects)
            hops.extend(held_result.hops or ())
        return Result(Outcome.CREATED, tx.state, effects or _NO_EFFECTS, tuple(hops) or None)

    def _settle(self, tx, ev: Event, out: list, hops: list) -> None:
        """Run eventless rows until none fires (bounded: the validator refuses cycles)."""
        fire_eventless = self._fire_eventless
        for _ in range(self._max_hops):
            here = tx.state
            fire = fire_eventless.get(here)
            if fire is None or not fire(tx, ev, out):
                return
            hops.append((here, tx.state))
        raise TransitionError(f"{self.spec.name}: eventless rows did not settle for transfer "
                              f"{tx.transfer_id!r}", transfer_id=tx.transfer_id, event=ev.kind)

    def _settle_traced(self, tx, ev: Event, out: list, hops: list, shard: _Shard) -> None:
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
            shard.fired += (taken - 1,)
            hops.append((here, tx.state))
        raise TransitionError(f"{self.spec.name}: eventless rows did not settle for transfer "
                              f"{tx.transfer_id!r}", transfer_id=tx.transfer_id, event=ev.kind)

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
                f"state {tx.state!r} after event {ev.kind!r} (the step was rolled back): {tx!r}")
        writes, emits = self._declared_after[row_index]
        changed = sorted(f for f, old in before.items()
                         if getattr(tx, f) is not old and getattr(tx, f) != old)
        undeclared = [f for f in changed if f not in writes]
        if undeclared:
            raise InvariantViolation(
                f"{self.spec.name}: transition #{row_index} changed {', '.join(undeclared)} of "
                f"transfer {tx.transfer_id!r}, which none of its actions (nor the eventless rows "
                "it can lead to) declares under writes; the step was rolled back")
        for effect in out:
            problem = effect_problem(self.spec, effect, emits)
            if problem:
                raise InvariantViolation(f"{self.spec.name}: transition #{row_index} {problem} "
                                         f"(transfer {tx.transfer_id!r}); the step was rolled back")

    def _finish(self, shard: _Shard, tx, ev: Event, outcome: Outcome, hops: list, out) -> Result:
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
                self._arm(tx, index, now)      # a deadline never moves before its heap entry
            else:
                deadlines[index] = now + duration
        if state in self._final:
            self._retire(shard, tx)
        shard.counts[outcome.index] += 1
        return Result(outcome, state, out or _NO_EFFECTS, tuple(hops) if hops else None)

    def _arm(self, tx, index: int, now: float) -> None:
        deadline = now + self._plan.durations[index]
        tx.deadlines[index] = deadline
        self._heap.push(deadline, tx, index)

    def _retire(self, shard: _Shard, tx) -> None:
        shard.live.pop(tx.transfer_id, None)
        tx.deadlines[:] = self._no_deadlines
        state = tx.state
        shard.ended_in[state] = shard.ended_in.get(state, 0) + 1
        if state in self._anomaly:
            try:
                log.warning("%s: transfer %r ended in anomaly state %r: %r",
                            self.spec.name, tx.transfer_id, state, tx)
            except Exception:           # a broken log handler must not undo a retirement
                pass
        ended = shard.ended
        ended[tx.transfer_id] = state
        if len(ended) > self._ended_cap:
            del ended[next(iter(ended))]


def _bound_senders(source: Any):
    """What a creating event's ``source`` binds its transfer to: None (anyone),
    ``FIRST_SENDER``, or a frozenset of senders; ``_REJECTED`` when it is no such thing."""
    if source.__class__ is not str:
        return _REJECTED
    if not source:
        return None
    if source == FIRST_SENDER:
        return FIRST_SENDER
    return frozenset(source.split(","))

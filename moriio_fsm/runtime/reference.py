"""The reference executor: the same spec run by a class-level ``transitions.Machine``.

pytransitions is the reference semantics: one ``Machine`` per spec is built with no
models, and each step triggers an event on a transfer record passed as the model
(``Event.trigger(model, ...)``), so records are never added to the machine. Its steps
have the same contract as the generated ones (atomic, counted, timers through the
table's ``finish``) and are 10-20x slower; they exist for debugging and for the
differential tests that demand identical results from both executors.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from transitions import Machine as PyTransitionsMachine
from transitions import State

from ..lang.model import value_fits
from .bindings import checked_action, checked_guard
from .errors import InvariantViolation, TransitionError
from .events import Event, Outcome, Result
from .machine import Machine
from .shard import Shard

#: The trigger name eventless rows get inside pytransitions; the loader refuses it as a
#: spec event name.
EVENTLESS_TRIGGER = "__eventless__"


class _Scratch:
    """Per-step data the callbacks share: the event, the effect list, what fired, and the
    binding running (for errors)."""

    __slots__ = ("event", "out", "outcome", "row", "binding")

    def __init__(self, event: Any, out: list):
        self.event = event
        self.out = out
        self.outcome = None
        self.row = None
        self.binding = ""


def _condition(row, guard):
    def check(event_data) -> bool:
        scratch = event_data.kwargs["scratch"]
        scratch.row, scratch.binding = row, row.guard_name
        verdict = bool(guard(event_data.model, scratch.event))
        scratch.binding = ""
        return verdict

    return check


def _before(row, actions):
    # 'before' callbacks run once the conditions held and before the state changes, so an
    # action sees the source state, as in the generated steps. A row that declares no
    # emits may not emit: both executors refuse it the same way.
    def run(event_data) -> None:
        scratch = event_data.kwargs["scratch"]
        scratch.row = row
        start = len(scratch.out)
        for name, action in zip(row.action_names, actions):
            scratch.binding = name
            action(event_data.model, scratch.event, scratch.out)
        scratch.binding = ""
        if not row.emits and len(scratch.out) > start:
            emitted = ", ".join(repr(e.kind) for e in scratch.out[start:])
            raise TransitionError(f"an action emitted {emitted} from a row that declares no emits")
        scratch.outcome = row.outcome

    return run


def _build_engine(machine: Machine, *, checked: bool) -> PyTransitionsMachine:
    """The class-level pytransitions machine of ``machine``. In check mode every guard
    runs on a read recorder and every action is followed by proofs of its declared
    writes and emits (``bindings.py``)."""
    spec = machine.spec
    engine = PyTransitionsMachine(
        model=None,
        states=[State(name, final=s.final) for name, s in spec.states.items()],
        initial=spec.initial,
        auto_transitions=False,
        send_event=True,
        ignore_invalid_triggers=True,
        model_attribute="state",
    )
    rows = machine.rows_by_index()
    allowed = machine.allowed_emits()
    for declared in spec.transitions:
        row = rows[declared.index]
        guard = row.guard
        actions = row.actions
        if checked:
            if guard is not None and row.guard_name is not None:  # a row has both or neither
                guard = checked_guard(spec, row.guard_name, guard)
            actions = tuple(
                checked_action(spec, name, fn, allowed.get(name, set()))
                for name, fn in zip(row.action_names, actions)
            )
        engine.add_transition(
            trigger=declared.event or EVENTLESS_TRIGGER,
            source=list(declared.sources),
            dest=declared.dest,
            conditions=[_condition(row, guard)] if guard else [],
            before=[_before(row, actions)],
        )
    return engine


class ReferenceSteps:
    """``steps[state][kind] -> fn(shard, tx, ev) -> Result`` backed by pytransitions."""

    def __init__(
        self,
        machine: Machine,
        *,
        result_cls: type,
        finish: Callable,
        verify: Callable | None,
        no_effects: tuple,
    ):
        self.machine = machine
        spec = machine.spec
        self._result = result_cls
        self._finish = finish
        self._verify = verify
        self._no_effects = no_effects
        self._fields = tuple(spec.context)
        # One pytransitions machine per spec machine and mode, built once: models are
        # never added to it, so every table can share it.
        cache = machine.__dict__.setdefault("_reference_engines", {})
        key = verify is not None
        if key not in cache:
            cache[key] = _build_engine(machine, checked=key)
        self.engine = cache[key]
        self._triggers = dict(self.engine.events)
        self._eventless_sources = {state: bool(rows) for state, rows in machine.eventless.items()}
        self._max_hops = len(spec.states) + 1
        self.steps: dict[str, dict[str, Callable]] = {
            state: {kind: self._step for kind in by_kind} for state, by_kind in machine.rows.items()
        }

    def _step(self, shard: Shard, tx: Any, ev: Event) -> Result:
        state = tx.state
        if not all(
            value_fits(getattr(ev, name), type_name)
            for name, type_name in self.machine.spec.events[ev.kind].payload.items()
        ):
            shard.counts[Outcome.REJECTED.index] += 1
            return self._result(Outcome.REJECTED, state, self._no_effects)
        saved = [getattr(tx, f) for f in self._fields]
        out: list = []
        scratch = probe = _Scratch(ev, out)
        try:
            self._triggers[ev.kind].trigger(tx, scratch=scratch)
            outcome = scratch.outcome
            if outcome is None:
                shard.counts[Outcome.REJECTED.index] += 1
                return self._result(Outcome.REJECTED, state, self._no_effects)
            hops = [(state, tx.state)] if tx.state != state else []
            if outcome is Outcome.APPLIED and EVENTLESS_TRIGGER in self._triggers:
                for _ in range(self._max_hops):
                    here = tx.state
                    if not self._eventless_sources.get(here):
                        break  # asking pytransitions would only log a warning
                    probe = _Scratch(ev, out)
                    self._triggers[EVENTLESS_TRIGGER].trigger(tx, scratch=probe)
                    if probe.outcome is None:
                        break
                    hops.append((here, tx.state))
                else:
                    raise TransitionError(
                        f"{self.machine.spec.name}: eventless rows did not settle "
                        f"for transfer {tx.transfer_id!r}"
                    )
            if self._verify is not None:
                self._verify(tx, ev, scratch.row.index, dict(zip(self._fields, saved)), out)
        except BaseException as exc:
            for field, value in zip(self._fields, saved):
                setattr(tx, field, value)
            tx.state = state
            if isinstance(exc, (TransitionError, InvariantViolation)) or not isinstance(
                exc, Exception
            ):
                raise
            failing = probe if probe.binding else scratch
            where = " a binding"
            if failing.binding and failing.row is not None:
                kind = "guard" if failing.binding == failing.row.guard_name else "action"
                where = (
                    f" {kind} {failing.binding!r} of transition #{failing.row.index} "
                    f"({self.machine.spec.path}:{failing.row.line})"
                )
            raise TransitionError(
                f"{self.machine.spec.name}:{where} raised {type(exc).__name__}: {exc} for "
                f"transfer {tx.transfer_id!r} in state {state!r} on event {ev.kind!r}; the step "
                "was rolled back",
                transfer_id=tx.transfer_id,
                event=ev.kind,
                binding=failing.binding,
            ) from exc
        if outcome is not Outcome.APPLIED:
            shard.counts[outcome.index] += 1
            return self._result(outcome, state, self._no_effects)
        return self._finish(shard, tx, ev, outcome, hops, out)

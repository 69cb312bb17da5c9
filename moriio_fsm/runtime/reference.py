"""The reference engine: the same spec run by a class-level ``transitions.Machine``.

pytransitions is the reference semantics: one ``Machine`` per spec is built with no
models, and each step triggers an event on a transfer record passed as the model
(``Event.trigger(model, ...)``), so records are never added to the machine. It is 20-30x
slower than ``CompiledMachine`` and exists for debugging and differential tests.
"""

from __future__ import annotations

from typing import Any

from transitions import Machine, State

from ..lang.model import Spec
from .compiled import CompiledMachine, TransitionError
from .events import Event, Outcome

_EVENTLESS = "__eventless__"


class _Step:
    """Per-step scratch passed to callbacks: the event, the effect list, what fired."""

    __slots__ = ("event", "out", "outcome")

    def __init__(self, event: Event, out: list):
        self.event = event
        self.out = out
        self.outcome = None


class TransitionsMachine(CompiledMachine):
    """Same interface as ``CompiledMachine``; transitions fire through pytransitions."""

    name = "transitions"

    def __init__(self, spec: Spec, bindings, config: dict[str, Any]):
        super().__init__(spec, bindings, config)   # record class, invariants, checks
        self.machine = Machine(
            model=None,
            states=[State(name, final=s.final) for name, s in spec.states.items()],
            initial=spec.initial, auto_transitions=False, send_event=True,
            ignore_invalid_triggers=True, model_attribute="state")
        outcomes = {"applied": Outcome.APPLIED, "duplicate": Outcome.DUPLICATE,
                    "ignored": Outcome.IGNORED}
        for t in spec.transitions:
            guard = bindings.guards[t.guard] if t.guard else None
            effects = tuple(bindings.effects[e] for e in t.effects)
            outcome = outcomes[t.outcome]
            conditions = [self._condition(guard)] if guard else []
            self.machine.add_transition(
                trigger=t.event or _EVENTLESS, source=list(t.sources), dest=t.dest,
                conditions=conditions, after=[self._after(effects, outcome)])
        self._triggers = {name: self.machine.events[name] for name in self.machine.events}

    @staticmethod
    def _condition(guard):
        def check(event_data) -> bool:
            step = event_data.kwargs["step"]
            return bool(guard(event_data.model, step.event))
        return check

    @staticmethod
    def _after(effects, outcome):
        # pytransitions runs 'after' callbacks once the state is set; effects of a
        # transition see the destination state, exactly as in CompiledMachine where
        # effects run before the state is written but never read it.
        def run(event_data) -> None:
            step = event_data.kwargs["step"]
            for effect in effects:
                effect(event_data.model, step.event, step.out)
            step.outcome = outcome
        return run

    def step(self, t, ev: Event, out: list) -> tuple[Outcome, list | None]:
        trigger = self._triggers.get(ev.kind)
        if trigger is None:
            return Outcome.REJECTED, None
        step = _Step(ev, out)
        before = t.state
        try:
            trigger.trigger(t, step=step)
            if step.outcome is None:
                return Outcome.REJECTED, None
            hops = [(before, t.state)] if t.state != before else None
            if step.outcome is Outcome.APPLIED and _EVENTLESS in self._triggers:
                eventless = self._triggers[_EVENTLESS]
                for _ in range(self._max_hops):
                    here = t.state
                    probe = _Step(ev, out)
                    eventless.trigger(t, step=probe)
                    if probe.outcome is None:
                        break
                    hops = (hops or []) + [(here, t.state)]
                else:
                    raise TransitionError(f"{self.spec.name}: eventless transitions did not settle")
            return step.outcome, hops
        except Exception as exc:
            raise self.binding_error(t, ev, exc) from exc

"""One machine alone, in a world that may hand it any event of its alphabet at any time.

Rules: a state is ``(now, record key, observer memory)``. From it the world may fire a
due timer; let time pass (to the next deadline, or by ``tick`` seconds short of it) when
no timer is due; or hand the transfer any event of the alphabet at ``now``, duplicates
and stale events included. Every step is the real one (``stepper.py``); what breaks is
reported by rule: ``invariant:<name>`` and ``declarations`` (check mode's verdicts),
``binding_raised``, the observer's effect rules, ``final_absorbing`` (some event changed
a transfer that had ended) and ``ends_without_peer`` (``explore.py``).
"""

from __future__ import annotations

import re
from typing import Any, NamedTuple

from ..runtime.errors import InvariantViolation, TransitionError
from ..runtime.events import Event, Outcome
from ..runtime.machine import Machine
from ..runtime.table import Result
from ..runtime.timers import TimerPlan
from .alphabet import Alphabet
from .bounds import Bounds
from .explore import Move
from .observer import INITIAL, Breach, Observer
from .stepper import TRANSFER_ID, Stepper

_INVARIANT = re.compile(r"invariant '([^']+)'")
_QUIET = (Outcome.REJECTED, Outcome.IGNORED, Outcome.DUPLICATE)


class Dispatch(NamedTuple):
    """A counterexample's step: ``machine`` was handed ``event`` at ``event.time`` and
    answered ``result`` (None when the step raised)."""

    machine: str
    event: Event
    result: Result | None


class TimePasses(NamedTuple):
    """A counterexample's step: the clock moved to ``now`` with nothing due before it."""

    now: float


def breach_of(exc: Exception) -> Breach:
    """The rule a step's exception broke."""
    if isinstance(exc, InvariantViolation):
        found = _INVARIANT.search(str(exc))
        return Breach(f"invariant:{found.group(1)}" if found else "declarations", str(exc))
    return Breach("binding_raised", str(exc))


def next_instant(now: float, deadlines, tick: float | None) -> float | None:
    """Where time may move when nothing is due: the earliest deadline, or ``tick``
    seconds on when that comes sooner; None when no timer is armed."""
    armed = [d for d in deadlines if d is not None]
    if not armed:
        return None
    earliest = min(armed)
    if tick is not None:
        stepped = round(now + tick, 9)
        if stepped < earliest:
            return stepped
    return earliest


class MachineModel:
    """The world of one machine (``Model`` for ``explore.search``)."""

    def __init__(self, machine: Machine, bounds: Bounds, domains: dict[str, tuple] | None = None):
        self.machine = machine
        self.name = machine.spec.name
        self.bounds = bounds
        self.stepper = Stepper(machine)
        self.alphabet = Alphabet(machine.spec, bounds, domains)
        self.observer = Observer(machine.spec, bounds.layers)
        self.tick = bounds.tick_for(TimerPlan(machine.spec, machine.config).durations, "off")
        self._final = machine.final
        self._timer_count = len(machine.spec.timers)

    # -- Model -------------------------------------------------------------------------

    def initial(self):
        for concrete in self.alphabet.creating:
            ev = concrete.build(TRANSFER_ID, 0.0)
            try:
                result, key = self.stepper.create(ev)
            except (InvariantViolation, TransitionError) as exc:
                yield Move(Dispatch(self.name, ev, None), None, 0, True, [breach_of(exc)])
                continue
            if key is None:
                continue  # the spec refused this way to start
            memory, breaches = self.observer.after(INITIAL, ev, result.effects, key[0])
            yield Move(Dispatch(self.name, ev, result), (0.0, key, memory), 0, True, breaches)

    def successors(self, state, allowance: int):
        now, key, memory = state
        tx = self.stepper.load(key)
        deadlines = key[1]
        moves = []
        due = False
        for index, deadline in enumerate(deadlines):
            if deadline is not None and deadline <= now:
                due = True
                moves.append(
                    self._try(tx, self.stepper.timer_event(index, deadline), now, memory, 0, True)
                )
        if not due:
            later = next_instant(now, deadlines, self.tick)
            if later is not None:
                moves.append(Move(TimePasses(later), (later, key, memory), 0, True, []))
        for concrete in self.alphabet.events:
            if concrete.cost > allowance:
                continue
            moves.append(
                self._try(
                    tx,
                    concrete.build(TRANSFER_ID, now),
                    now,
                    memory,
                    concrete.cost,
                    concrete.origin == "local",
                )
            )
        return moves

    def ended(self, state) -> bool:
        return state[1][0] in self._final

    def end_breaches(self, state) -> list[Breach]:
        """Every event (and every timer) handed to the ended transfer must change
        nothing and emit nothing."""
        now, key, _ = state
        tx = self.stepper.load(key)
        kinds = [c.build(TRANSFER_ID, now) for c in self.alphabet.events]
        kinds += [self.stepper.timer_event(i, now) for i in range(self._timer_count)]
        for ev in kinds:
            try:
                result, after = self.stepper.run(tx, ev)
            except (InvariantViolation, TransitionError) as exc:
                return [
                    Breach("final_absorbing", f"{ev.kind} raised in final state {key[0]!r}: {exc}")
                ]
            if after != key or result.effects or result.outcome not in _QUIET:
                return [
                    Breach(
                        "final_absorbing",
                        f"{ev.kind} was {result.outcome.value} in final state {key[0]!r}"
                        f" (now {after[0]!r}, effects {list(result.effects)!r})",
                    )
                ]
        return []

    def describe_stuck(self, state) -> str:
        now, key, _ = state
        armed = [name for name, d in zip(self.machine.spec.timers, key[1]) if d is not None]
        return (
            f"for example in state {key[0]!r} at t={now:g} with "
            f"{'timers ' + ', '.join(armed) + ' armed' if armed else 'no timer armed'}"
        )

    # -- one step ----------------------------------------------------------------------

    def _try(self, tx, ev: Event, now: float, memory: tuple, cost: int, peer_free: bool) -> Move:
        try:
            result, key = self.stepper.run(tx, ev)
        except (InvariantViolation, TransitionError) as exc:
            return Move(Dispatch(self.name, ev, None), None, cost, peer_free, [breach_of(exc)])
        memory, breaches = self.observer.after(memory, ev, result.effects, key[0])
        return Move(Dispatch(self.name, ev, result), (now, key, memory), cost, peer_free, breaches)

    def context_of(self, state) -> dict[str, Any]:
        return self.stepper.context_of(state[1])

    def trace_sides(self) -> dict[str, tuple[str, Machine]]:
        """Trace side and machine of each machine label in this model's counterexamples."""
        return {self.name: ("checker", self.machine)}

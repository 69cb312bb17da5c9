"""Compile a spec plus its bindings into a fast, table-driven machine.

Theory of operation: a transfer is a small slotted record (``state``, the spec's
context fields, one deadline slot per timer). ``CompiledMachine.step`` looks up
``table[state][event kind]``, tries the candidate transitions in spec order, runs the
first whose guard holds, then runs eventless transitions until none fires. It reads
no clock and does no I/O; the caller gets the outcome and the list of state hops.
"""

from __future__ import annotations

from ..errors import MoriioFsmError

from typing import Any, Callable

from ..lang.expr import compile_predicate
from ..lang.model import Spec
from .events import Event, Outcome

_OUTCOMES = {"applied": Outcome.APPLIED, "duplicate": Outcome.DUPLICATE,
             "ignored": Outcome.IGNORED}
_APPLIED = Outcome.APPLIED
_REJECTED = Outcome.REJECTED


class TransitionError(MoriioFsmError, RuntimeError):
    """A guard or effect binding raised: a bug in a machine module, never a peer's fault."""


class InvariantViolation(MoriioFsmError, AssertionError):
    """A spec invariant stopped holding after a step (raised only when checking is on)."""


def make_record_class(spec: Spec, config: dict[str, Any]) -> type:
    """Build the per-transfer record class for ``spec``.

    The class has ``__slots__`` only (no per-instance dict), so a live transfer costs a
    fixed few hundred bytes whatever its number of layers. ``config`` is shared by all
    records as a class attribute, and each config key is also a class attribute so a
    guard reads ``t.max_layers`` at attribute speed.
    """
    fields = tuple(spec.context)
    clash = sorted(set(fields) & set(config))
    if clash:
        raise ValueError(f"{spec.path}: names used both as context field and config key: "
                         f"{', '.join(clash)}")
    initial = tuple(f.initial for f in spec.context.values())
    num_timers = len(spec.timers)
    initial_state = spec.initial

    def __init__(self, transfer_id: str) -> None:
        self.transfer_id = transfer_id
        self.state = initial_state
        self.deadlines = [None] * num_timers if num_timers else None
        for name, value in zip(fields, initial):
            setattr(self, name, value)

    def __repr__(self) -> str:
        ctx = ", ".join(f"{n}={getattr(self, n)!r}" for n in fields)
        return f"<{spec.name} {self.transfer_id} state={self.state} {ctx}>"

    def context(self) -> dict[str, Any]:
        """A snapshot of the context fields as a plain dict."""
        return {n: getattr(self, n) for n in fields}

    cls_name = "".join(part.capitalize() for part in spec.name.split("_")) + "Transfer"
    return type(cls_name, (), {
        "__slots__": ("transfer_id", "state", "deadlines") + fields,
        "__init__": __init__, "__repr__": __repr__, "context": context,
        "config": dict(config), "spec_name": spec.name, "field_names": fields,
        **config,
    })


class CompiledMachine:
    """The hot-path engine: transitions as dict lookups with guards and effects bound once."""

    name = "compiled"

    def __init__(self, spec: Spec, bindings, config: dict[str, Any]):
        bindings.check(spec)
        self.spec = spec
        self.record_class = make_record_class(spec, config)
        # table[state][event] -> tuple of (guard, dest, effects, outcome, transition index)
        self.table: dict[str, dict[str, tuple]] = {s: {} for s in spec.states}
        self.eventless: dict[str, tuple] = {s: () for s in spec.states}
        for t in spec.transitions:
            row = (bindings.guards[t.guard] if t.guard else None, t.dest,
                   tuple(bindings.effects[e] for e in t.effects), _OUTCOMES[t.outcome], t.index)
            for s in t.sources:
                if t.event is None:
                    self.eventless[s] += (row,)
                else:
                    self.table[s].setdefault(t.event, ())
                    self.table[s][t.event] += (row,)
        self.final = frozenset(spec.final_states)
        self._max_hops = len(spec.states) + 1
        self.invariants: tuple[tuple[str, Callable[[Any], bool]], ...] = tuple(
            (inv.name, compile_predicate(inv.expr, spec.context)) for inv in spec.invariants)

    def step(self, t, ev: Event, out: list) -> tuple[Outcome, list | None]:
        """Apply ``ev`` to record ``t``; append effects to ``out``.

        Returns ``(outcome, hops)`` where ``hops`` lists ``(from, to)`` state changes
        in order, or ``None`` when the state did not change. ``REJECTED`` means the
        spec has no transition for this event in this state (nothing changed).
        """
        candidates = self.table[t.state].get(ev.kind)
        if candidates is None:
            return _REJECTED, None
        try:
            for guard, dest, effects, outcome, _ in candidates:
                if guard is None or guard(t, ev):
                    for effect in effects:
                        effect(t, ev, out)
                    hops = None
                    if dest is not None and dest != t.state:
                        # A self-loop is not a state change: no hop, no timer re-arm.
                        hops = [(t.state, dest)]
                        t.state = dest
                    if outcome is _APPLIED and self.eventless[t.state]:
                        hops = self._settle(t, ev, out, hops)
                    return outcome, hops
        except Exception as exc:
            raise self.binding_error(t, ev, exc) from exc
        return _REJECTED, None

    def binding_error(self, t, ev: Event, exc: Exception) -> Exception:
        """The error to raise when a guard or effect raised ``exc`` (passed through when
        it is already one of ours)."""
        if isinstance(exc, (TransitionError, InvariantViolation)):
            return exc
        return TransitionError(
            f"{self.spec.name}: binding failed for transfer {t.transfer_id!r} in state "
            f"{t.state!r} on event {ev.kind!r}: {type(exc).__name__}: {exc}")

    def _settle(self, t, ev: Event, out: list, hops: list | None) -> list | None:
        """Run eventless transitions until none fires (bounded: the spec has no cycles)."""
        for _ in range(self._max_hops):
            for guard, dest, effects, _, _ in self.eventless[t.state]:
                if guard is None or guard(t, ev):
                    for effect in effects:
                        effect(t, ev, out)
                    if hops is None:
                        hops = []
                    hops.append((t.state, dest))
                    t.state = dest
                    break
            else:
                return hops
        raise TransitionError(f"{self.spec.name}: eventless transitions did not settle for "
                              f"transfer {t.transfer_id!r}")

    def check_invariants(self, t, ev: Event) -> None:
        """Raise ``InvariantViolation`` naming the first invariant that does not hold
        (or that could not be evaluated on this context)."""
        for name, predicate in self.invariants:
            try:
                holds = predicate(t)
            except Exception as exc:
                raise InvariantViolation(
                    f"{self.spec.name}: invariant {name!r} could not be evaluated for "
                    f"transfer {t.transfer_id!r} after event {ev.kind!r}: "
                    f"{type(exc).__name__}: {exc}") from exc
            if not holds:
                raise InvariantViolation(
                    f"{self.spec.name}: invariant {name!r} broken for transfer "
                    f"{t.transfer_id!r} in state {t.state!r} after event {ev.kind!r}: {t!r}")

"""The in-memory form of a transfer spec: plain frozen dataclasses.

A ``Spec`` is what the YAML loader produces and what everything else (compiler,
reference engine, validator, diagrams) consumes. It holds names only; guards and
effects are bound to Python later, by ``moriio_fsm.machines``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

#: Context field types a spec may declare, and the Python types their values take.
CONTEXT_TYPES: dict[str, tuple[type, ...]] = {
    "int": (int,),
    "bool": (bool,),
    "float": (float, int),
    "str": (str,),
    "bitmap": (int,),        # a set of small integers kept as the bits of one int
    "object": (object,),     # opaque payload held by reference (block id lists)
}

#: Payload field types an event may declare, and the Python types a value may take.
PAYLOAD_TYPES: dict[str, tuple[type, ...]] = {
    "int": (int,), "float": (float, int), "str": (str,), "bool": (bool,),
    "list": (list, tuple), "any": (object,),
}

#: Attribute names every transfer record already uses; context fields and config keys
#: may not take them.
RESERVED_NAMES = frozenset({"transfer_id", "state", "deadlines", "context", "config",
                            "spec_name", "field_names"})

#: Where an event comes from. Only ``local`` events may create a transfer.
EVENT_ORIGINS = ("local", "remote", "timer")

#: Outcomes a transition may declare for itself instead of the default "applied".
TRANSITION_OUTCOMES = ("applied", "duplicate", "ignored")


@dataclass(frozen=True)
class ConfigKey:
    name: str
    default: Any
    doc: str
    line: int


@dataclass(frozen=True)
class ContextField:
    name: str
    type: str
    initial: Any
    doc: str
    line: int


@dataclass(frozen=True)
class StateSpec:
    name: str
    doc: str
    final: bool
    line: int


@dataclass(frozen=True)
class EventSpec:
    name: str
    origin: str
    doc: str
    payload: dict[str, str]
    creates: bool
    line: int


@dataclass(frozen=True)
class TransitionSpec:
    """One row of the transition table.

    ``event`` is ``None`` for an eventless transition, which fires as soon as its
    guard holds after any step. ``dest`` is ``None`` for an internal transition
    (effects run, the state stays, no exit or entry happens).
    """

    index: int
    event: str | None
    sources: tuple[str, ...]
    dest: str | None
    guard: str | None
    effects: tuple[str, ...]
    outcome: str
    line: int

    @property
    def internal(self) -> bool:
        return self.dest is None

    def label(self) -> str:
        trigger = self.event or "(eventless)"
        return f"transition #{self.index} ({trigger} from {', '.join(self.sources)})"


@dataclass(frozen=True)
class TimerSpec:
    """A deadline armed while the transfer is in one of ``states``.

    It is armed on entry into the set (or re-entry after it fired), disarmed on
    leaving the set, pushed back by every applied event in ``restart_on``, and
    fires ``event`` when its deadline passes.
    """

    name: str
    states: tuple[str, ...]
    duration_key: str
    event: str
    restart_on: tuple[str, ...]
    line: int


@dataclass(frozen=True)
class InvariantSpec:
    name: str
    expr: str
    line: int


@dataclass(frozen=True)
class Spec:
    name: str
    summary: str
    path: str
    initial: str
    config: dict[str, ConfigKey]
    context: dict[str, ContextField]
    states: dict[str, StateSpec]
    events: dict[str, EventSpec]
    guards: dict[str, tuple[str, int]]     # name -> (doc, line)
    effects: dict[str, tuple[str, int]]    # name -> (doc, line)
    transitions: tuple[TransitionSpec, ...]
    timers: dict[str, TimerSpec]
    invariants: tuple[InvariantSpec, ...]
    line: int = 1
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def final_states(self) -> tuple[str, ...]:
        return tuple(n for n, s in self.states.items() if s.final)

    def default_config(self) -> dict[str, Any]:
        return {k: c.default for k, c in self.config.items()}

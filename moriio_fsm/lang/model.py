"""The in-memory form of a transfer spec: plain frozen dataclasses.

A ``Spec`` is what the YAML loader produces and what everything else (code generator,
reference executor, validator, driver, diagrams) consumes. It holds names and
declarations only; guards and actions are bound to Python later, by
``moriio_fsm.machines``, and checked against what is declared here.

Vocabulary, one meaning each: a *guard* is a named test of a transfer's context; an
*action* is a named update of it; an *emit* is a kind of effect the outside world must
carry out (``post_write``, ``send_write_done``...), declared with its fields.
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
    "bitmap": (int,),  # a set of small integers kept as the bits of one int
    "object": (object,),  # opaque payload held by reference (block id lists)
}

#: Field types an event payload or an emitted effect may declare, and the Python types
#: a value may take. ``list`` admits tuples too: both are sequences on the wire.
FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "int": (int,),
    "float": (float, int),
    "str": (str,),
    "bool": (bool,),
    "list": (list, tuple),
    "tuple": (tuple,),
    "any": (object,),
}


def value_fits(value: Any, type_name: str) -> bool:
    """Whether ``value`` is of the declared field type ``type_name`` (``bool`` is not an
    ``int`` here, and ``None`` fits only ``any``)."""
    if type_name == "int":
        return type(value) is int
    if type_name == "float":
        return type(value) is float or type(value) is int
    if type_name == "bool":
        return type(value) is bool
    if type_name == "any":
        return True
    return isinstance(value, FIELD_TYPES[type_name])


#: Fields every event already has; a payload field may not take these names.
EVENT_FIELDS = frozenset({"transfer_id", "time", "source", "kind", "data"})

#: Attribute names every transfer record already uses; context fields and config keys
#: may not take them.
RESERVED_NAMES = frozenset(
    {"transfer_id", "state", "deadlines", "context", "config", "spec_name", "field_names"}
)

#: Where an event comes from. ``local``: the host (vLLM's scheduler and forward pass),
#: whose request lifecycle always ends; ``adapter``: an adapter of this side reporting
#: on work it was asked to do (an RDMA completion, a failed handler); ``remote``: the
#: peer; ``timer``: a deadline of this transfer. Only ``local`` events create transfers,
#: and only ``local`` and ``timer`` events count as a way out that needs nobody else.
EVENT_ORIGINS = ("local", "adapter", "remote", "timer")

#: Outcomes a transition may declare for itself instead of the default "applied".
TRANSITION_OUTCOMES = ("applied", "duplicate", "ignored")


@dataclass(frozen=True)
class ConfigRef:
    """A config key of a machine, named ``machine.key`` in a spec (``line``: where)."""

    machine: str
    key: str
    line: int

    def __str__(self) -> str:
        return f"{self.machine}.{self.key}"


@dataclass(frozen=True)
class ConfigKey:
    """A timeout or limit. ``exceeds`` is its bound: the keys, of this machine or of the
    machines it runs with, whose values' sum its value must exceed (empty: no bound)."""

    name: str
    default: Any
    doc: str
    line: int
    exceeds: tuple[ConfigRef, ...] = ()


@dataclass(frozen=True)
class ContextField:
    name: str
    type: str
    initial: Any
    doc: str
    line: int


@dataclass(frozen=True)
class StateSpec:
    """One state. ``anomaly`` marks a final state that ends a transfer without a safe
    verdict (e.g. writes that may still land): reaching it is counted and logged."""

    name: str
    doc: str
    final: bool
    line: int
    anomaly: bool = False


@dataclass(frozen=True)
class EventSpec:
    """One event kind: where it comes from and its payload fields (name -> type), of
    which those in ``defaults`` may be left out."""

    name: str
    origin: str
    doc: str
    payload: dict[str, str]
    creates: bool
    line: int
    defaults: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class GuardSpec:
    """A named test; ``reads`` lists the context fields and config keys it reads."""

    name: str
    doc: str
    reads: tuple[str, ...]
    line: int


@dataclass(frozen=True)
class ActionSpec:
    """A named update of the context; ``writes`` lists every field it may change."""

    name: str
    doc: str
    writes: tuple[str, ...]
    line: int


@dataclass(frozen=True)
class EmitSpec:
    """A kind of effect: its fields with their types, and the event a driver dispatches
    to the transfer when the handler carrying it out fails (``on_failure``)."""

    name: str
    doc: str
    fields: dict[str, str]
    on_failure: str | None
    line: int


@dataclass(frozen=True)
class TransitionSpec:
    """One row of the transition table.

    ``event`` is ``None`` for an eventless transition, which fires as soon as its
    guard holds after any step. ``dest`` is ``None`` for an internal transition
    (actions run, the state stays, no exit or entry happens). ``actions`` run in order;
    ``emits`` lists the effect kinds those actions may emit.
    """

    index: int
    event: str | None
    sources: tuple[str, ...]
    dest: str | None
    guard: str | None
    actions: tuple[str, ...]
    emits: tuple[str, ...]
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
    guards: dict[str, GuardSpec]
    actions: dict[str, ActionSpec]
    emits: dict[str, EmitSpec]
    transitions: tuple[TransitionSpec, ...]
    timers: dict[str, TimerSpec]
    invariants: tuple[InvariantSpec, ...]
    line: int = 1
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def final_states(self) -> tuple[str, ...]:
        return tuple(n for n, s in self.states.items() if s.final)

    @property
    def anomaly_states(self) -> tuple[str, ...]:
        return tuple(n for n, s in self.states.items() if s.anomaly)

    def default_config(self) -> dict[str, Any]:
        return {k: c.default for k, c in self.config.items()}

    def row_line(self, index: int) -> str:
        """``path:line`` of transition row ``index``, for error messages."""
        return f"{self.path}:{self.transitions[index].line}"

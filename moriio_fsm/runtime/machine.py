"""A spec bound to its Python guards and actions: the input of both executors.

``Machine`` resolves every name once: per (state, event) the rows to try in spec order,
per state the eventless rows, the record class a live transfer is stored in, the
effect classes of the declared emits and the compiled invariants. It runs nothing
itself; ``codegen`` turns it into step functions and ``reference`` into a pytransitions
machine.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..lang.expr import compile_predicate
from ..lang.model import Spec
from .bindings import Bindings
from .declared import register_spec
from .events import Outcome

_OUTCOMES = {"applied": Outcome.APPLIED, "duplicate": Outcome.DUPLICATE, "ignored": Outcome.IGNORED}


@dataclass(frozen=True)
class Row:
    """One transition row with its bindings resolved (``guard`` None: unguarded)."""

    index: int
    event: str | None
    guard_name: str | None
    guard: Callable | None
    dest: str | None
    action_names: tuple[str, ...]
    actions: tuple[Callable, ...]
    emits: tuple[str, ...]
    outcome: Outcome
    line: int


def make_record_class(spec: Spec, config: dict[str, Any]) -> type[Any]:
    """Build the per-transfer record class for ``spec``.

    The class has ``__slots__`` only (no per-instance dict), so a live transfer costs a
    fixed few hundred bytes whatever its number of layers. ``config`` is shared by all
    records as a class attribute, and each config key is also a class attribute so a
    guard reads ``tx.max_layers`` at attribute speed.
    """
    fields = tuple(spec.context)
    clash = sorted(set(fields) & set(config))
    if clash:
        raise ValueError(
            f"{spec.path}: names used both as context field and config key: {', '.join(clash)}"
        )
    initial = tuple(f.initial for f in spec.context.values())
    num_timers = len(spec.timers)
    initial_state = spec.initial

    # __init__ is generated with one assignment per field: a transfer is created per
    # request, and a loop of setattr calls would cost several times as much.
    namespace: dict[str, Any] = {"INITIAL_STATE": initial_state}
    lines = [
        "def __init__(self, transfer_id):",
        "    self.transfer_id = transfer_id",
        "    self.state = INITIAL_STATE",
        f"    self.deadlines = [None] * {num_timers}",
        "    self._senders = None",
    ]
    for index, (name, value) in enumerate(zip(fields, initial)):
        namespace[f"INITIAL_{index}"] = value
        lines.append(f"    self.{name} = INITIAL_{index}")
    # A copy likewise (``copy_record``): the model checker copies a record before every
    # step it tries. It sits under a leading underscore, which no context field or config
    # key may use, so no spec can shadow it.
    lines += [
        "",
        "def copy(self):",
        "    other = CLASS.__new__(CLASS)",
        "    other.transfer_id = self.transfer_id",
        "    other.state = self.state",
        "    other.deadlines = list(self.deadlines)",
        "    other._senders = self._senders",
    ]
    lines += [f"    other.{name} = self.{name}" for name in fields]
    lines.append("    return other")
    exec(compile("\n".join(lines) + "\n", f"<moriio-fsm record {spec.name}>", "exec"), namespace)  # noqa: S102
    __init__ = namespace["__init__"]
    copy = namespace["copy"]

    def __repr__(self) -> str:
        ctx = ", ".join(f"{n}={getattr(self, n)!r}" for n in fields)
        return f"<{spec.name} {self.transfer_id} state={self.state} {ctx}>"

    def context(self) -> dict[str, Any]:
        """A snapshot of the context fields as a plain dict."""
        return {n: getattr(self, n) for n in fields}

    cls_name = "".join(part.capitalize() for part in spec.name.split("_")) + "Transfer"
    cls = type(
        cls_name,
        (),
        {
            # _senders: the peers whose facts the transfer takes (TransferTable's binding).
            "__slots__": ("transfer_id", "state", "deadlines", "_senders") + fields,
            "__init__": __init__,
            "__repr__": __repr__,
            "context": context,
            "_copy": copy,
            "config": dict(config),
            "spec_name": spec.name,
            "field_names": fields,
            **config,
        },
    )
    namespace["CLASS"] = cls
    return cls


def copy_record(tx):
    """A new record of ``tx``'s class with the same id, state, deadlines (a list of its
    own) and context values. Values are shared: steps replace them, never mutate them
    (bitmaps are ints; block id lists are never changed)."""
    return tx._copy()


class Machine:
    """``spec`` + ``bindings`` + resolved ``config``, checked to agree."""

    def __init__(self, spec: Spec, bindings: Bindings, config: dict[str, Any]):
        bindings.check(spec)
        self.event_classes, self.effect_classes = register_spec(spec)
        self.spec = spec
        self.bindings = bindings
        self.config = dict(config)
        self.record_class = make_record_class(spec, config)
        self.final = frozenset(spec.final_states)
        self.anomaly = frozenset(spec.anomaly_states)
        guards = bindings.guards
        actions = bindings.actions
        #: rows[state][event] -> rows to try in order; eventless[state] -> eventless rows
        self.rows: dict[str, dict[str, tuple[Row, ...]]] = {s: {} for s in spec.states}
        self.eventless: dict[str, tuple[Row, ...]] = {s: () for s in spec.states}
        for declared in spec.transitions:
            row = Row(
                declared.index,
                declared.event,
                declared.guard,
                guards[declared.guard] if declared.guard else None,
                declared.dest,
                declared.actions,
                tuple(actions[a] for a in declared.actions),
                declared.emits,
                _OUTCOMES[declared.outcome],
                declared.line,
            )
            for state in declared.sources:
                if declared.event is None:
                    self.eventless[state] += (row,)
                else:
                    self.rows[state][declared.event] = self.rows[state].get(declared.event, ()) + (
                        row,
                    )
        self.invariants: tuple[tuple[str, Callable[[Any], bool]], ...] = tuple(
            (inv.name, compile_predicate(inv.expr, [*spec.context, "state"]))
            for inv in spec.invariants
        )

    def allowed_emits(self) -> dict[str, set[str]]:
        """Per action, the effect kinds every row running it declares."""
        allowed: dict[str, set[str]] = {}
        for row in self.spec.transitions:
            for name in row.actions:
                allowed[name] = (
                    allowed[name] & set(row.emits) if name in allowed else set(row.emits)
                )
        return allowed

    def rows_by_index(self) -> dict[int, Row]:
        found = {
            row.index: row
            for by_kind in self.rows.values()
            for rows in by_kind.values()
            for row in rows
        }
        found.update({row.index: row for rows in self.eventless.values() for row in rows})
        return found

    def declared_after(self) -> dict[int, tuple[frozenset, frozenset]]:
        """Per row, every field it and the eventless rows it can lead to may write, and
        every effect kind they may emit (what check mode holds each step to)."""
        cached = self.__dict__.get("_declared_after")
        if cached is None:
            cached = {}
            for row in self.rows_by_index().values():
                sources = self.spec.transitions[row.index].sources
                reach = self.eventless_closure({row.dest} if row.dest else set(sources))
                follow = [r for s in reach for r in self.eventless[s]]
                cached[row.index] = (
                    frozenset(self.writes_of([row, *follow])),
                    frozenset(row.emits) | {e for r in follow for e in r.emits},
                )
            self._declared_after = cached
        return cached

    def writes_of(self, rows) -> set[str]:
        """Every context field the actions of ``rows`` may write."""
        return {w for row in rows for a in row.action_names for w in self.spec.actions[a].writes}

    def reads_of(self, rows) -> set[str]:
        """Every field the guards of ``rows`` may read."""
        return {r for row in rows if row.guard_name for r in self.spec.guards[row.guard_name].reads}

    def eventless_closure(self, states) -> set[str]:
        """``states`` and every state eventless rows can reach from them."""
        seen = set(states)
        stack = list(states)
        while stack:
            for row in self.eventless[stack.pop()]:
                if row.dest is not None and row.dest not in seen:
                    seen.add(row.dest)
                    stack.append(row.dest)
        return seen

    def broken_invariant(self, tx) -> tuple[str, str] | None:
        """``(name, why)`` of the first invariant that does not hold on ``tx``, or None."""
        for name, predicate in self.invariants:
            try:
                if not predicate(tx):
                    return name, "does not hold"
            except Exception as exc:  # an invariant that cannot be evaluated is broken
                return name, f"could not be evaluated: {type(exc).__name__}: {exc}"
        return None

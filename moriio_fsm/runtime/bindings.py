"""Binding a spec's named guards and actions to Python functions, and checking that the
two agree: every name bound and declared, every field a binding touches declared.

The runtime owns this machinery (machines, both executors and check mode use it); the
per-spec modules of ``moriio_fsm.machines`` only fill a ``Bindings`` each. A machine
module creates one ``Bindings`` and decorates its functions with
``@bindings.guard`` and ``@bindings.action``. Signatures: ``guard(transfer, event) ->
bool`` reads the context (only the fields its spec entry ``reads``) and changes nothing;
``action(transfer, event, out)`` changes only the fields its entry ``writes`` and emits
effects with ``out.append(emits.<kind>(transfer.transfer_id, field=value, ...))`` (``emits``:
``moriio_fsm.runtime.declared``).
Neither performs I/O.

``check`` reads each binding's bytecode: the attributes a guard loads, the attributes an
action stores and the ``emits.<kind>`` it builds must all be declared, and every row
running an action must list that action's emits. Check mode (``check_invariants=True``)
verifies the same at run time, value by value (``checked_guard``/``checked_action``).
"""

from __future__ import annotations

import dis
import types
from collections.abc import Callable, Iterator, Set
from typing import Any

from ..lang.errors import Problem, SpecError
from ..lang.model import FIELD_TYPES, Spec
from .events import Effect

__all__ = [
    "Bindings",
    "attribute_loads",
    "attribute_stores",
    "emitted_kinds",
    "checked_guard",
    "checked_action",
    "effect_problem",
]

Guard = Callable[[Any, Any], bool]
Action = Callable[[Any, Any, list], None]

_LOADS = {"LOAD_ATTR", "LOAD_METHOD"}


def _code_objects(fn: Callable) -> Iterator[types.CodeType]:
    """The code of ``fn`` and of every function nested in it."""
    stack = [getattr(fn, "__code__", None)]
    while stack:
        code = stack.pop()
        if code is None:
            continue
        yield code
        stack.extend(c for c in code.co_consts if isinstance(c, types.CodeType))


def attribute_loads(fn: Callable) -> set[str]:
    """Names of every attribute ``fn`` reads off its first parameter (the transfer),
    in its own code and in functions nested in it (off their first parameter)."""
    names: set[str] = set()
    for code in _code_objects(fn):
        if not code.co_argcount:
            continue
        record = code.co_varnames[0]
        on_record = False
        for ins in dis.get_instructions(code):
            if ins.opname in ("CACHE", "EXTENDED_ARG", "PRECALL"):
                continue
            if ins.opname in _LOADS and on_record:
                names.add(ins.argval)
            if ins.opname == "LOAD_FAST" and ins.argval == record:
                on_record = True
            elif ins.opname != "COPY":  # 'tx.x |= y' loads tx, copies it, loads x
                on_record = False
    return names


def attribute_stores(fn: Callable) -> set[str]:
    """Names of every attribute ``fn`` (or a function nested in it) assigns."""
    return {
        ins.argval
        for code in _code_objects(fn)
        for ins in dis.get_instructions(code)
        if ins.opname in ("STORE_ATTR", "DELETE_ATTR")
    }


def emitted_kinds(fn: Callable) -> set[str]:
    """The ``<kind>`` of every ``emits.<kind>(...)`` written in ``fn``."""
    kinds: set[str] = set()
    for code in _code_objects(fn):
        previous = None
        for ins in dis.get_instructions(code):
            if (
                previous is not None
                and ins.opname in _LOADS
                and previous.opname in ("LOAD_GLOBAL", "LOAD_NAME", "LOAD_DEREF", "LOAD_FAST")
                and previous.argval == "emits"
            ):
                kinds.add(ins.argval)
            if ins.opname not in ("CACHE", "EXTENDED_ARG", "PRECALL"):
                previous = ins
    return kinds


class Bindings:
    """The Python half of one spec: its guard and action functions by name."""

    def __init__(self, spec_name: str):
        self.spec_name = spec_name
        self.guards: dict[str, Guard] = {}
        self.actions: dict[str, Action] = {}

    def guard(self, fn: Guard) -> Guard:
        self._add(self.guards, fn, "guard")
        return fn

    def action(self, fn: Action) -> Action:
        self._add(self.actions, fn, "action")
        return fn

    def _add(self, table: dict, fn: Callable, kind: str) -> None:
        if fn.__name__ in table:
            raise ValueError(f"{kind} {fn.__name__!r} is bound twice for spec {self.spec_name!r}")
        table[fn.__name__] = fn

    def replaced(self, *functions: Callable) -> Bindings:
        """A copy in which each of ``functions`` stands in for the guard or action of its name.

        Used to plant a bug in one step (tests, the model checker's own tests) without
        touching the bindings every other machine of this spec shares.
        """
        copy = Bindings(self.spec_name)
        copy.guards = dict(self.guards)
        copy.actions = dict(self.actions)
        for fn in functions:
            if fn.__name__ in copy.guards:
                copy.guards[fn.__name__] = fn
            elif fn.__name__ in copy.actions:
                copy.actions[fn.__name__] = fn
            else:
                raise ValueError(
                    f"{fn.__name__!r} is neither a guard nor an action of spec {self.spec_name!r}"
                )
        return copy

    def action_emits(self, name: str) -> set[str]:
        """The effect kinds the bound action ``name`` may emit, read from its bytecode."""
        return emitted_kinds(self.actions[name])

    def check(self, spec: Spec) -> None:
        """Raise ``SpecError`` unless the bindings and ``spec`` agree in every name and
        field, as far as the bindings' bytecode shows (see the module docstring)."""
        found = [
            *self._name_problems(spec),
            *self._guard_problems(spec),
            *self._action_problems(spec),
            *self._row_problems(spec),
        ]
        if found:
            raise SpecError([Problem(spec.path, line, message) for line, message in found])

    def _name_problems(self, spec: Spec) -> Iterator[tuple[int, str]]:
        """The spec's name, and every guard and action name, on both sides."""
        if spec.name != self.spec_name:
            yield (
                spec.line,
                f"spec is named {spec.name!r} but the bindings are for {self.spec_name!r}",
            )
        for kind, declared, bound in (
            ("guard", spec.guards, self.guards),
            ("action", spec.actions, self.actions),
        ):
            for name, item in declared.items():
                if name not in bound:
                    yield (
                        item.line,
                        f"{kind} {name!r} is declared in the spec but has no Python "
                        f"binding in the {self.spec_name!r} machine module",
                    )
            for name in bound:
                if name not in declared:
                    yield (
                        spec.line,
                        f"{kind} {name!r} is bound in Python but not declared under "
                        f"'{kind}s' in the spec",
                    )

    def _guard_problems(self, spec: Spec) -> Iterator[tuple[int, str]]:
        """Each guard reads only the fields its entry declares, and assigns none."""
        readable = set(spec.context) | set(spec.config)
        for name, item in spec.guards.items():
            fn = self.guards.get(name)
            if fn is None:
                continue
            undeclared = sorted((attribute_loads(fn) & readable) - set(item.reads))
            if undeclared:
                yield (
                    item.line,
                    f"guard {name!r} reads {', '.join(undeclared)} but its spec entry "
                    f"declares reads: [{', '.join(item.reads)}]",
                )
            stored = sorted(attribute_stores(fn))
            if stored:
                yield item.line, f"guard {name!r} assigns {', '.join(stored)}; a guard only reads"

    def _action_problems(self, spec: Spec) -> Iterator[tuple[int, str]]:
        """Each action writes only the fields its entry declares and emits declared kinds."""
        fields = set(spec.context)
        for name, item in spec.actions.items():
            action = self.actions.get(name)
            if action is None:
                continue
            undeclared = sorted((attribute_stores(action) & fields) - set(item.writes))
            if undeclared:
                yield (
                    item.line,
                    f"action {name!r} writes {', '.join(undeclared)} but its spec entry "
                    f"declares writes: [{', '.join(item.writes)}]",
                )
            for kind in sorted(emitted_kinds(action) - set(spec.emits)):
                yield (
                    item.line,
                    f"action {name!r} emits {kind!r}, which is not declared under 'emits'",
                )

    def _row_problems(self, spec: Spec) -> Iterator[tuple[int, str]]:
        """Each row lists exactly the emits its actions may build."""
        for row in spec.transitions:
            may_emit: set[str] = set()
            for name in row.actions:
                if name in self.actions:
                    may_emit |= emitted_kinds(self.actions[name]) & set(spec.emits)
            for kind in sorted(may_emit - set(row.emits)):
                yield (
                    row.line,
                    f"{row.label()} runs an action that emits {kind!r}, but the row "
                    f"does not list it under emits",
                )
            for kind in sorted(set(row.emits) - may_emit):
                yield (
                    row.line,
                    f"{row.label()} lists emit {kind!r}, but none of its actions "
                    f"({', '.join(row.actions) or 'none'}) emits it",
                )


# -- check mode: bindings wrapped so that every run proves what the spec declares ----------


class _ReadRecorder:
    """Stands in for a transfer record while a guard runs: records what it reads and
    refuses writes."""

    __slots__ = ("_record", "_reads")

    def __init__(self, record: Any) -> None:
        object.__setattr__(self, "_record", record)
        object.__setattr__(self, "_reads", set())

    def __getattr__(self, name: str) -> Any:
        self._reads.add(name)
        return getattr(self._record, name)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"a guard assigned {name!r}; guards only read the context")


def checked_guard(spec: Spec, name: str, fn: Guard) -> Guard:
    """``fn`` run on a read recorder: reading an undeclared field raises ``AssertionError``."""
    allowed = set(spec.guards[name].reads) | {"transfer_id", "state"}
    fields = set(spec.context) | set(spec.config)

    def guard(transfer: Any, ev: Any) -> bool:
        recorder = _ReadRecorder(transfer)
        verdict = fn(recorder, ev)
        undeclared = sorted((recorder._reads & fields) - allowed)
        if undeclared:
            raise AssertionError(
                f"guard {name!r} read {', '.join(undeclared)}, which its spec "
                f"entry does not declare under reads"
            )
        return verdict

    guard.__name__ = guard.__qualname__ = name
    return guard


def checked_action(spec: Spec, name: str, fn: Action, allowed_emits: set[str]) -> Action:
    """``fn`` followed by proofs: only declared fields changed, only ``allowed_emits``
    kinds emitted, each with exactly the declared fields and types."""
    writes = set(spec.actions[name].writes)
    fields = tuple(spec.context)

    def action(transfer: Any, ev: Any, out: list) -> None:
        before = [getattr(transfer, f) for f in fields]
        start = len(out)
        fn(transfer, ev, out)
        changed = [
            f
            for f, old in zip(fields, before)
            if getattr(transfer, f) is not old and getattr(transfer, f) != old
        ]
        undeclared = sorted(set(changed) - writes)
        if undeclared:
            raise AssertionError(
                f"action {name!r} changed {', '.join(undeclared)}, which its "
                "spec entry does not declare under writes"
            )
        for effect in out[start:]:
            problem = effect_problem(spec, effect, allowed_emits)
            if problem:
                raise AssertionError(f"action {name!r}: {problem}")

    action.__name__ = action.__qualname__ = name
    return action


def effect_problem(spec: Spec, effect: Effect, allowed: Set[str]) -> str | None:
    """Why ``effect`` does not match the spec's declaration of its kind, or None."""
    declared = spec.emits.get(effect.kind)
    if declared is None:
        return f"emitted {effect.kind!r}, which the spec does not declare under emits"
    if effect.kind not in allowed:
        return f"emitted {effect.kind!r} from a row that does not list it under emits"
    got, want = set(effect.data), set(declared.fields)
    if got != want:
        missing, extra = sorted(want - got), sorted(got - want)
        return (
            f"emitted {effect.kind!r} with fields {sorted(got)}; declared {sorted(want)}"
            + (f" (missing {missing})" if missing else "")
            + (f" (extra {extra})" if extra else "")
        )
    for field_name, type_name in declared.fields.items():
        value = effect.data[field_name]
        types_ = FIELD_TYPES[type_name]
        if not isinstance(value, types_) or (
            isinstance(value, bool) and bool not in types_ and type_name != "any"
        ):
            return (
                f"emitted {effect.kind!r} with {field_name}={value!r}, which is not of the "
                f"declared type {type_name}"
            )
    return None

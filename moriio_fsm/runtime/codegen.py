"""Generate the step functions of a machine: one Python function per (state, event).

Theory of operation: ``GeneratedSteps`` writes one readable Python module per machine
(registered with ``linecache``, so tracebacks and debuggers show its lines) holding
``step_<state>__<event>(shard, tx, ev) -> Result`` for every pair the spec handles and
``eventless_<state>(tx, ev, out) -> bool`` for every state with eventless rows. A step
tries its rows in spec order. Guards and actions are inlined where ``inline.py`` can do
so exactly, and called otherwise; each inlined line carries a comment naming its
binding. Rows that keep the state restart timers inline and return a ready ``Result``;
rows that change state (or may enable an eventless row) hand over to the table's
``finish``, which applies the timer rules to the hops and retires final transfers.

Rules: a step is atomic. Once a row's guard holds, the step saves every context field
that row and the eventless rows it can lead to may write (as the spec declares), and
if anything raises before the step's result exists it restores them and the state;
timers, counters and the table change only after that point. The error names the
binding and the spec row, read off the generated line the traceback stopped at. Check
mode writes the same module plus a snapshot and one ``verify`` call per row. Trace mode
(a table with a step recorder) writes the same module plus one ``shard.fired += (row,)``
per row taken, so a trace names every row that ran; the plain module is unchanged.
Nothing of a path or a name becomes code (``codegen_text.py``); lines, names and compiling
are ``codegen_source.py``; what the steps call while they run (the rollback, the effect
list of rows without emits) is ``step_rollback.py``.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .codegen_source import FILENAME_PREFIX, ModuleSource, Origin
from .codegen_text import TYPE_TESTS, attribute_name, ident, index_literal, number_literal, one_line
from .errors import InvariantViolation, TransitionError
from .events import Outcome
from .inline import inline_action, inline_guard
from .machine import Machine, Row
from .step_rollback import NoEffects, restore
from .timers import TimerPlan


@dataclass(frozen=True)
class _RowShape:
    """What one row does to a step, worked out before its lines are written."""

    dest: str | None  # the state it moves to; None when it keeps the state
    writes: set[str]  # the fields its actions may write
    may_settle: bool  # whether an eventless row may fire after it
    follow_writes: set[str]  # the fields those eventless rows may write besides
    settle_emits: bool  # whether those eventless rows emit
    index: int  # the row's index in the spec


def _named_guard(row: Row) -> tuple[str, Callable]:
    """A guarded row's guard name and function (a row has both or neither)."""
    assert row.guard_name is not None and row.guard is not None, f"row #{row.index} is unguarded"
    return row.guard_name, row.guard


def _guard_info(row: Row) -> Origin:
    """What a generated line of a guarded row's guard came from, for error reports."""
    return ("guard", _named_guard(row)[0], row)


class GeneratedModule(ModuleSource):
    """The generated module of one machine in one mode (with or without check mode): its
    source, compiled code and the map from generated lines back to bindings and rows.

    It is written and compiled once per machine and mode (``generate_steps`` caches it
    on the machine); every table then runs it in a namespace of its own, with its own
    ``finish``, ``arm``, ``settle`` and ``verify``.
    """

    def __init__(
        self,
        machine: Machine,
        plan: TimerPlan,
        *,
        result_cls: type,
        no_effects: tuple,
        verify: bool,
        trace: bool = False,
    ):
        self.machine = machine
        # Trace mode: every row taken adds its index to the tuple ``shard.fired`` (a tuple:
        # one row, the common case, allocates nothing and keeps nothing for the GC); eventless
        # functions return that index + 1 (still truthy) for the table's traced settle.
        self._trace = trace
        spec = machine.spec
        namespace: dict[str, Any] = {
            "Result": result_cls,
            "finish": None,
            "arm": None,
            "settle": None,
            "verify": None,
            "NO_EFFECTS": no_effects,
            "NO_OUT": NoEffects(),
            "failure": self._failure,
            "restore": restore,
            "undeclared_read": self._undeclared_read,
        }
        super().__init__(
            namespace,
            f"# Steps generated from {one_line(spec.path)} "
            f"({one_line(spec.name)}{', trace mode' if trace else ''}); "
            "do not edit: regenerated at every build.",
        )
        self._results: dict[tuple[Outcome, str], Any] = {}
        self._plan = plan
        self._verify = verify
        self._eventless_reads = {s: machine.reads_of(rows) for s, rows in machine.eventless.items()}
        self._inlined: dict[tuple, Any] = {}
        self._hoisted: frozenset = frozenset()  # event fields the current step read up front
        self.inlined_bindings: set[str] = set()
        self.called_bindings: set[str] = set()

        self._eventless_names: dict[str, str] = {}
        self._may_fire: dict[str, str] = {}
        for state, rows in machine.eventless.items():
            if rows:
                self._eventless_names[state] = self._emit_eventless(state, rows)
                self._may_fire[state] = self._emit_may_fire(state, rows)
        self._step_names: dict[tuple[str, str], str] = {}
        for state, by_kind in machine.rows.items():
            for kind, rows in by_kind.items():
                self._step_names[(state, kind)] = self._emit_step(state, kind, rows)

        self._compile(spec.name)

    def bind(
        self, *, finish: Callable, arm: Callable, settle: Callable, verify: Callable | None
    ) -> GeneratedSteps:
        """Run the module for one table; return its step functions."""
        namespace = dict(self._ns, finish=finish, arm=arm, settle=settle, verify=verify)
        exec(self.code, namespace)  # noqa: S102 - built from the spec above
        eventless = {s: namespace[n] for s, n in self._eventless_names.items()}
        steps: dict[str, dict[str, Callable]] = {s: {} for s in self.machine.spec.states}
        for (state, kind), name in self._step_names.items():
            steps[state][kind] = namespace[name]
        return GeneratedSteps(self, steps, eventless)

    # -- writing the module ----------------------------------------------------------------

    def _where(self, row: Row) -> str:
        """Where ``row`` is declared, for a comment (escaped: the path is anyone's)."""
        return one_line(f"transition #{row.index}, {self.machine.spec.path}:{row.line}")

    def _inline(self, kind: str, name: str, fn: Callable):
        key = (kind, name, self._hoisted)
        if key not in self._inlined:
            inliner = inline_guard if kind == "guard" else inline_action
            self._inlined[key] = inliner(
                fn, self._bind, self.machine.config, self.machine.effect_classes, self._hoisted
            )
            (self.inlined_bindings if self._inlined[key] else self.called_bindings).add(name)
        return self._inlined[key]

    def _guard(self, row: Row, indent: str) -> str:
        """Write the guard's preparatory lines; return the test expression to branch on."""
        name, guard = _named_guard(row)
        info = _guard_info(row)
        inlined = self._inline("guard", name, guard)
        if inlined is None:
            return f"{self._bind(guard, 'guard_' + name)}(tx, ev)"
        for text in inlined.lines:
            self._line(f"{indent}{text}  # guard {one_line(name)}", info)
        return inlined.test

    def _actions(self, row: Row, indent: str) -> None:
        for name, fn in zip(row.action_names, row.actions):
            info = ("action", name, row)
            inlined = self._inline("action", name, fn)
            if inlined is None:
                self._line(
                    f"{indent}{self._bind(fn, 'action_' + name)}(tx, ev, out)  "
                    f"# action {one_line(name)}",
                    info,
                )
                continue
            for text in inlined.lines:
                self._line(f"{indent}{text}  # action {one_line(name)}", info)

    def _branch(self, row: Row, indent: str) -> str:
        """Open the row's guard (if any); return the indentation of the row's body."""
        if row.guard is None:
            self._line(f"{indent}# unguarded row ({self._where(row)})")
            return indent
        test = self._guard(row, indent)
        self._line(
            f"{indent}if {test}:  # {one_line(row.guard_name)} ({self._where(row)})",
            _guard_info(row),
        )
        return indent + "    "

    def _emit_may_fire(self, state: str, rows: tuple[Row, ...]) -> str:
        """``may_fire_<state>(tx, ev)``: whether an eventless row of ``state`` would fire;
        the guards run in order, as in ``eventless_<state>``, and change nothing."""
        name = self._unique(f"may_fire_{ident(state)}")
        self._hoisted = frozenset()
        self._line("")
        self._line(f"def {name}(tx, ev):")
        for row in rows:
            if row.guard is None:
                self._line("    return True")
                return name
            test = self._guard(row, "    ")
            self._line(
                f"    if {test}:  # {one_line(row.guard_name)} ({self._where(row)})",
                _guard_info(row),
            )
            self._line("        return True")
        self._line("    return False")
        return name

    def _eventless_test(self, state: str, indent: str) -> str:
        """The test, in a step, that an eventless row of ``state`` may fire: the guards
        inlined when each is one expression, else a call of ``may_fire_<state>``."""
        tests = []
        for row in self.machine.eventless[state]:
            if row.guard is None:
                return "True"
            inlined = self._inline("guard", *_named_guard(row))
            if inlined is None or inlined.lines:
                return f"{self._may_fire[state]}(tx, ev)"
            tests.append(inlined.test)
        return " or ".join(tests)

    def _emit_eventless(self, state: str, rows: tuple[Row, ...]) -> str:
        name = self._unique(f"eventless_{ident(state)}")
        self._hoisted = frozenset()  # called from every kind's steps: read ev itself
        self._line("")
        self._line(f"def {name}(tx, ev, out):")
        self._line(f"    # eventless rows of state {state!r}: the first whose guard holds fires")
        for row in rows:
            body = self._branch(row, "    ")
            self._actions(row, body)
            self._line(f"{body}tx.state = {row.dest!r}")
            taken = index_literal(row.index, "a row index") + 1 if self._trace else True
            self._line(f"{body}return {taken}")
            if row.guard is None:
                return name
        self._line("    return False")
        return name

    def _emit_step(self, state: str, kind: str, rows: tuple[Row, ...]) -> str:
        name = self._unique(f"step_{ident(state)}__{ident(kind)}")
        self._line("")
        self._line(f"def {name}(shard, tx, ev):")
        self._line(f"    # {one_line(self.machine.spec.name)}: event {kind!r} in state {state!r}")
        self._line("    try:")
        # Events are immutable: their payload is read once, into ev_<field> locals, and a
        # field that is not of its declared type rejects the event before any row runs.
        payload = self.machine.spec.events[kind].payload
        self._hoisted = frozenset(payload)
        rejected = self._bind(
            self._result(Outcome.REJECTED, state), f"REJECTED_IN_{ident(state).upper()}"
        )
        for field, type_name in payload.items():
            field = attribute_name(field)
            self._line(f"        ev_{field} = ev.{field}")
            test = TYPE_TESTS[type_name].format(f"ev_{field}")
            if test:
                self._line(f"        if {test}:  # not a {type_name}")
                self._line(f"            shard.counts[{Outcome.REJECTED.index}] += 1")
                self._line(f"            return {rejected}")
        exhausted = False
        for row in rows:
            body = self._branch(row, "        ")
            self._emit_row(state, kind, row, body)
            if row.guard is None:
                exhausted = True  # the validator refuses rows after an unguarded one
                break
        if not exhausted:
            rejected = self._bind(
                self._result(Outcome.REJECTED, state), f"REJECTED_IN_{ident(state).upper()}"
            )
            self._line(f"        shard.counts[{Outcome.REJECTED.index}] += 1  # no row took it")
            self._line(f"        return {rejected}")
        self._line("    except BaseException as exc:")
        self._line(f"        restore(tx, locals(), {state!r})")
        self._line(f"        error = failure(exc, tx, ev, {state!r})")
        self._line("        if error is exc:")
        self._line("            raise")
        self._line("        raise error from exc")
        return name

    def _emit_row(self, state: str, kind: str, row: Row, indent: str) -> None:
        """The body of one row whose guard held: saves, actions, then the state change
        (handed to ``finish``) or, keeping the state, the follow-ups, checks, timer
        restarts and the counted result."""
        shape = self._row_shape(state, row)
        self._emit_row_start(row, shape, indent)
        self._actions(row, indent)
        outcome = self._bind(row.outcome, row.outcome.name)
        if shape.dest is not None:
            self._emit_state_change(state, shape.dest, shape, outcome, indent)
            return
        if shape.may_settle:
            self._emit_settle_in_place(state, row, shape, outcome, indent)
        if self._verify:
            self._emit_kept_state_check(state, row, shape, indent)
        if row.outcome is Outcome.APPLIED:
            self._emit_restarts(kind, state, indent)
        cached = self._bind(
            self._result(row.outcome, state), f"{row.outcome.name}_IN_{ident(state).upper()}"
        )
        self._line(f"{indent}shard.counts[{row.outcome.index}] += 1  # {row.outcome.value}")
        if row.emits:
            self._line(f"{indent}return Result({outcome}, {state!r}, out) if out else {cached}")
        else:
            self._line(f"{indent}return {cached}")

    def _row_shape(self, state: str, row: Row) -> _RowShape:
        machine = self.machine
        dest = None if row.dest in (None, state) else row.dest  # a self-loop keeps the state
        writes = machine.writes_of([row])
        may_settle = row.outcome is Outcome.APPLIED and (
            (dest is not None and bool(machine.eventless[dest]))
            or (dest is None and bool(writes & self._eventless_reads[state]))
        )
        closure = machine.eventless_closure({dest or state}) if may_settle else set()
        closure_rows = [r for s in closure for r in machine.eventless[s]]
        return _RowShape(
            dest,
            writes,
            may_settle,
            machine.writes_of(closure_rows) - writes,
            any(r.emits for r in closure_rows),
            index_literal(row.index, "a row index"),
        )

    def _emit_row_start(self, row: Row, shape: _RowShape, indent: str) -> None:
        """The trace note, the saves a rollback needs, check mode's snapshot and ``out``."""
        if self._trace:
            self._line(
                f"{indent}shard.fired += ({shape.index},)  # trace: transition #{shape.index}"
            )
        saved = shape.writes if shape.dest is None else shape.writes | shape.follow_writes
        for field in sorted(saved):
            field = attribute_name(field)
            self._line(f"{indent}saved_{field} = tx.{field}")
        if self._verify:
            self._line(f"{indent}before = tx.context()")
        if row.emits or (shape.dest is not None and shape.settle_emits):
            self._line(f"{indent}out = []")
        elif row.actions or shape.may_settle or shape.dest is not None:
            self._line(f"{indent}out = NO_OUT")
        elif self._verify:
            self._line(f"{indent}out = NO_EFFECTS")

    def _settle_call(self) -> str:
        return "settle(tx, ev, out, hops, shard)" if self._trace else "settle(tx, ev, out, hops)"

    def _emit_state_change(
        self, state: str, dest: str, shape: _RowShape, outcome: str, indent: str
    ) -> None:
        self._line(f"{indent}tx.state = {dest!r}")
        self._line(f"{indent}hops = [({state!r}, {dest!r})]")
        if self.machine.eventless[dest]:
            self._line(f"{indent}{self._settle_call()}")
        if self._verify:
            self._line(f"{indent}verify(tx, ev, {shape.index}, before, out)")
        self._line(f"{indent}return finish(shard, tx, ev, {outcome}, hops, out)")

    def _emit_settle_in_place(
        self, state: str, row: Row, shape: _RowShape, outcome: str, indent: str
    ) -> None:
        # The state's eventless guards, tested in place: only when one holds does the
        # step pay for the follow-up (a list for its effects, the saves, the hops).
        test = self._eventless_test(state, indent)
        self._line(f"{indent}if {test}:  # an eventless row of {state!r} may fire")
        inner = indent + "    "
        for field in sorted(shape.follow_writes):
            field = attribute_name(field)
            self._line(f"{inner}saved_{field} = tx.{field}")
        if shape.settle_emits and not row.emits:
            self._line(f"{inner}out = []")
        self._line(f"{inner}hops = []")
        self._line(f"{inner}{self._settle_call()}")
        if self._verify:
            self._line(f"{inner}verify(tx, ev, {shape.index}, before, out)")
        self._line(f"{inner}return finish(shard, tx, ev, {outcome}, hops, out)")

    def _emit_kept_state_check(self, state: str, row: Row, shape: _RowShape, indent: str) -> None:
        self._line(f"{indent}verify(tx, ev, {shape.index}, before, out)")
        if (
            row.outcome is Outcome.APPLIED
            and not shape.may_settle
            and self.machine.eventless[state]
        ):
            # The step skipped the eventless rows because the declarations say this
            # row writes nothing their guards read; check mode proves it.
            self._line(f"{indent}if {self._may_fire[state]}(tx, ev):")
            self._line(f"{indent}    undeclared_read(tx, ev, {shape.index}, {state!r})")

    def _emit_restarts(self, kind: str, state: str, indent: str) -> None:
        restarts = self._plan.restarts(kind, state)
        if restarts:
            self._line(f"{indent}deadlines = tx.deadlines")
        for timer, duration in restarts:
            # TimerPlan's restart rule: arm anew if it fired (or would move earlier than
            # its heap entry), else push the deadline back.
            self._line(
                f"{indent}deadline = deadlines[{timer}]  "
                f"# restart timer {self._plan.names[timer]!r}"
            )
            self._line(f"{indent}pushed_back = ev.time + {number_literal(duration, 'a duration')}")
            self._line(f"{indent}if deadline is None or pushed_back < deadline:")
            self._line(f"{indent}    arm(tx, {timer}, ev.time)")
            self._line(f"{indent}else:")
            self._line(f"{indent}    deadlines[{timer}] = pushed_back")

    def _result(self, outcome: Outcome, state: str):
        """The one shared effect-free ``Result`` of ``outcome`` in ``state``."""
        key = (outcome, state)
        cached = self._results.get(key)
        if cached is None:
            cached = self._results[key] = self._ns["Result"](outcome, state, self._ns["NO_EFFECTS"])
        return cached

    # -- errors --------------------------------------------------------------------------

    def _undeclared_read(self, tx: Any, ev: Any, row_index: int, state: str) -> None:
        raise InvariantViolation(
            f"{self.machine.spec.name}: after transition #{row_index} an eventless row of "
            f"{state!r} would fire for transfer {tx.transfer_id!r} on event {ev.kind!r}, but "
            "no field the row writes is declared as read by those guards: a guard reads a "
            "field its spec entry does not declare (the step was rolled back)"
        )

    def _failure(self, exc: BaseException, tx: Any, ev: Any, state: str) -> BaseException:
        """The error to raise for ``exc`` raised inside a step: ours pass through; others
        become a ``TransitionError`` naming the binding and the row it belongs to."""
        if isinstance(exc, (TransitionError, InvariantViolation)) or not isinstance(exc, Exception):
            return exc
        spec = self.machine.spec
        where, binding = "", ""
        origin = self._origin(exc)
        if origin is not None:
            what, binding, row = origin
            where = f" {what} {binding!r} of transition #{row.index} ({spec.path}:{row.line})"
        return TransitionError(
            f"{spec.name}:{where or ' a binding'} raised {type(exc).__name__}: {exc} for "
            f"transfer {tx.transfer_id!r} in state {state!r} on event {ev.kind!r}; the step was "
            "rolled back",
            transfer_id=tx.transfer_id,
            event=ev.kind,
            binding=binding,
        )


class GeneratedSteps:
    """One table's step functions (``steps[state][kind]``) and eventless functions,
    with the module they came from (``source``, ``filename``)."""

    def __init__(self, module: GeneratedModule, steps: dict, eventless: dict):
        self.module = module
        self.steps = steps
        self.eventless = eventless
        self.source = module.source
        self.filename = module.filename
        self.inlined_bindings = module.inlined_bindings
        self.called_bindings = module.called_bindings


def generate_steps(
    machine: Machine,
    plan: TimerPlan,
    *,
    result_cls: type,
    no_effects: tuple,
    finish: Callable,
    arm: Callable,
    settle: Callable,
    verify: Callable | None,
    trace: bool = False,
) -> GeneratedSteps:
    """The step functions of ``machine`` for one table (the module is written once per
    machine and mode and kept on the machine). ``trace``: the trace-mode module, whose
    steps note the rows they take in ``shard.fired`` and call ``settle`` with the shard."""
    cache = machine.__dict__.setdefault("_generated_modules", {})
    key = (verify is not None, result_cls, trace)
    module = cache.get(key)
    if module is None:
        module = cache[key] = GeneratedModule(
            machine,
            plan,
            result_cls=result_cls,
            no_effects=no_effects,
            verify=verify is not None,
            trace=trace,
        )
    return module.bind(finish=finish, arm=arm, settle=settle, verify=verify)


def is_generated(code: types.CodeType) -> bool:
    """True for code objects of generated steps (for debuggers and tests)."""
    return code.co_filename.startswith(FILENAME_PREFIX)

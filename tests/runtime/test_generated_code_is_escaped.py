"""Paths and names never become code in the generated step module.

A spec's path and its names reach the generated module in comments, string literals and
function names. Whatever they hold (line breaks, U+2028, quotes, backslashes, '#', triple
quotes, NUL, letters Python folds to others), the module must compile to the same code,
behave the same, and keep one source line per line Python counts, so tracebacks show the
right line. Hostile paths come through the loader (a real file under a hostile folder);
names the loader refuses are put into a parsed spec directly.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import shutil

import pytest

from moriio_fsm.lang.loader import parse_spec
from moriio_fsm.machines import build_table, spec_path
from moriio_fsm.runtime.bindings import Bindings
from moriio_fsm.runtime.errors import TransitionError
from moriio_fsm.runtime.machine import Machine
from moriio_fsm.runtime.table import TransferTable
from moriio_fsm.trace import TraceRecorder

from ..trace.conftest import lifecycle


def node_kinds(source: str) -> list[str]:
    """The module's syntax tree as the sequence of its node types: equal for two modules
    exactly when neither holds a statement or expression the other does not."""
    return [type(node).__name__ for node in ast.walk(ast.parse(source))]


def assert_one_line_per_line(source: str) -> None:
    # Python counts lines at \n (and \r); linecache and tracebacks split at every line
    # boundary str.splitlines knows (U+2028, \x85, \x0c...). They must agree.
    assert source.splitlines() == source.split("\n")[:-1]


# -- a hostile spec path, through the loader --------------------------------------------

HOSTILE_FOLDERS = [
    "evil\nHIJACKED = True\n#",
    "evil\rHIJACKED = True",
    "sep\u2028HIJACKED = 1",
    "para\u2029nel\x85vt\x0bff\x0c",
    "quote\"'\"\"\"'''",
    "hash # \\ back\\slash",
    "esc\x1b[2J",
]


@pytest.mark.parametrize("folder", HOSTILE_FOLDERS, ids=range(len(HOSTILE_FOLDERS)))
def test_a_spec_path_with_line_breaks_and_quotes_becomes_no_code(tmp_path, folder):
    hostile = tmp_path / folder / "write_producer.yaml"
    hostile.parent.mkdir()
    shutil.copyfile(spec_path("write_producer"), hostile)
    tables = {"shipped": build_table("write_producer"), "hostile": build_table(str(hostile))}
    assert tables["hostile"].spec.path == str(hostile)
    shipped, theirs = (tables[k].generated for k in ("shipped", "hostile"))
    assert_one_line_per_line(theirs.source)
    assert node_kinds(theirs.source) == node_kinds(shipped.source)
    for steps in theirs.steps.values():
        for step in steps.values():
            step = step.func if isinstance(step, functools.partial) else step
            assert "HIJACKED" not in step.__globals__
    for table in tables.values():
        lifecycle(table, "tx-1", layers=2)
    assert tables["hostile"].state_of("tx-1") == tables["shipped"].state_of("tx-1") == "released"


def test_a_hostile_spec_path_in_trace_mode_compiles_and_records(tmp_path):
    hostile = tmp_path / "a\nb\u2028c" / "write_producer.yaml"
    hostile.parent.mkdir()
    shutil.copyfile(spec_path("write_producer"), hostile)
    recorder = TraceRecorder("P0")
    table = build_table(str(hostile), recorder=recorder)
    lifecycle(table, "tx-1", layers=1)
    assert_one_line_per_line(table.generated.source)
    assert recorder.records("tx-1")[-1].after == "released"


# -- hostile names, put into a parsed spec -----------------------------------------------

PLAIN = """
name: escaping_plain
initial: esc_start
config: {esc_wait_s: {default: 5.0}}
context: {n: {type: int, initial: 0}}
states: {esc_start: {doc: start}, esc_mid: {doc: middle}, esc_done: {final: true},
         esc_gone: {final: true}}
events:
  esc_begin: {origin: local, creates: true}
  esc_go: {origin: local, payload: {size: int}}
  esc_end: {origin: local}
  esc_tick: {origin: timer}
guards: {esc_small: {reads: [n]}}
actions: {esc_bump: {writes: [n]}}
timers: {esc_timer: {states: [esc_mid], duration: esc_wait_s, event: esc_tick,
                      restart_on: [esc_go]}}
transitions:
  - {event: esc_begin, source: esc_start, internal: true, actions: [esc_bump]}
  - {event: esc_go, source: esc_start, dest: esc_mid, guard: esc_small, actions: [esc_bump]}
  - {event: esc_go, source: esc_mid, internal: true, guard: esc_small, actions: [esc_bump]}
  - {event: esc_go, source: [esc_start, esc_mid], internal: true, outcome: ignored}
  - {event: esc_end, source: esc_mid, dest: esc_done}
  - {event: esc_tick, source: esc_mid, dest: esc_gone}
"""

#: Every name of the plain spec, and what the hostile one calls it.
HOSTILE_NAMES = {
    "escaping_plain": 'spec\n"""name\u2028',
    "esc_start": "it's\nHIJACKED = 1",
    "esc_mid": 'say "hi" \\ # not a comment',
    "esc_done": "'''done'''\u2028",
    "esc_gone": '"""\r\x85gone\x00\ud800',
    "esc_begin": "begin\nHIJACKED = 2\n",
    "esc_go": "go\u2029'\"",
    "esc_end": "end\\\n#",
    "esc_tick": "tick\x0b\x0c\x1c",
    "esc_small": "small\n    HIJACKED = 3\n#",
    "esc_bump": "bump\r\n        HIJACKED = 4",
    "esc_timer": "timer'''\n",
}


def renamed(spec, names: dict[str, str], path: str):
    """``spec`` with every state, event, guard, action and timer name (and its own name
    and path) replaced as ``names`` says; a name not in ``names`` stays."""

    def n(name):
        return None if name is None else names.get(name, name)

    def keyed(section):
        return {n(key): dataclasses.replace(value, name=n(key)) for key, value in section.items()}

    rows = tuple(
        dataclasses.replace(
            row,
            event=n(row.event),
            sources=tuple(map(n, row.sources)),
            dest=n(row.dest),
            guard=n(row.guard),
            actions=tuple(map(n, row.actions)),
        )
        for row in spec.transitions
    )
    timers = {
        n(key): dataclasses.replace(
            timer,
            name=n(key),
            states=tuple(map(n, timer.states)),
            event=n(timer.event),
            restart_on=tuple(map(n, timer.restart_on)),
        )
        for key, timer in spec.timers.items()
    }
    return dataclasses.replace(
        spec,
        name=n(spec.name),
        path=path,
        initial=n(spec.initial),
        states=keyed(spec.states),
        events=keyed(spec.events),
        guards=keyed(spec.guards),
        actions=keyed(spec.actions),
        transitions=rows,
        timers=timers,
    )


def bindings_for(spec_name: str, names: dict[str, str]) -> Bindings:
    def small(tx, ev):
        return tx.n < 3

    def bump(tx, ev, out):
        if getattr(ev, "size", 0) == 99:
            raise RuntimeError("planted")
        tx.n += 1

    small.__name__ = names.get("esc_small", "esc_small")
    bump.__name__ = names.get("esc_bump", "esc_bump")
    bindings = Bindings(spec_name)
    bindings.guard(small)
    bindings.action(bump)
    return bindings


def machine_named(names: dict[str, str], path: str) -> Machine:
    spec = renamed(parse_spec(PLAIN, "escaping.yaml"), names, path)
    return Machine(spec, bindings_for(spec.name, names), spec.default_config())


def run(table: TransferTable, names: dict[str, str]) -> list[tuple]:
    """The same story on either machine, as (outcome, state in plain names, effects)."""
    plain = {hostile: name for name, hostile in names.items()}
    events = table.machine.event_classes

    def kind(name):
        return events[names.get(name, name)]

    script = [
        kind("esc_begin")("x", 0.0),
        kind("esc_go")("x", 1.0, size=1),
        kind("esc_go")("x", 2.0, size=2),
        kind("esc_go")("x", 3.0, size=3),
        kind("esc_end")("x", 4.0),
        kind("esc_begin")("y", 5.0),
        kind("esc_go")("y", 6.0, size=1),
    ]
    seen = [
        (r.outcome, plain.get(r.state, r.state), r.effects) for r in map(table.dispatch, script)
    ]
    seen.append(
        tuple(
            (tid, plain.get(state, state))
            for tid, state in ((tid, table.state_of(tid)) for tid in ("x", "y"))
        )
    )
    fired = table.advance(100.0)  # y's timer: its tick ends it
    seen.append(
        [
            (plain.get(ev.kind, ev.kind), ev.transfer_id, r.outcome, plain.get(r.state, r.state))
            for ev, r in fired
        ]
    )
    return seen


@pytest.mark.parametrize("mode", ["plain", "check", "trace"])
def test_hostile_names_become_no_code_and_change_no_step(mode):
    options = {"check": {"check_invariants": True}, "trace": {"recorder": TraceRecorder("P0")}}.get(
        mode, {}
    )
    plain = TransferTable(machine_named({}, "escaping.yaml"), **options)
    options = {**options, **({"recorder": TraceRecorder("P1")} if mode == "trace" else {})}
    hostile = TransferTable(machine_named(HOSTILE_NAMES, 'C:\\x\n"""\u2028.yaml'), **options)
    source = hostile.generated.source
    assert_one_line_per_line(source)
    assert node_kinds(source) == node_kinds(plain.generated.source)
    assert all(isinstance(node, ast.FunctionDef) for node in ast.parse(source).body)
    assert run(hostile, HOSTILE_NAMES) == run(plain, {})


def test_a_binding_that_raises_is_named_by_its_hostile_name():
    table = TransferTable(machine_named(HOSTILE_NAMES, "p\n#\u2028.yaml"))
    events = table.machine.event_classes
    table.dispatch(events[HOSTILE_NAMES["esc_begin"]]("x", 0.0))
    with pytest.raises(TransitionError) as caught:
        table.dispatch(events[HOSTILE_NAMES["esc_go"]]("x", 1.0, size=99))
    # The generated line the traceback stopped at maps back to the binding and its row.
    assert caught.value.binding == HOSTILE_NAMES["esc_bump"]
    assert table.state_of("x") == HOSTILE_NAMES["esc_start"]


FOLDED = """
name: escaping_folded
initial: esc_start
context: {n: {type: int, initial: 0}}
states: {esc_start: {doc: start}, "\\ufb01": {doc: ligature}, fi: {doc: plain},
         esc_done: {final: true}}
events:
  esc_begin: {origin: local, creates: true}
  esc_go: {origin: local, payload: {size: int}}
  esc_end: {origin: local}
guards: {esc_small: {reads: [n]}}
actions: {esc_bump: {writes: [n]}}
transitions:
  - {event: esc_begin, source: esc_start, internal: true, actions: [esc_bump]}
  - {event: esc_go, source: esc_start, dest: "\\ufb01", guard: esc_small, actions: [esc_bump]}
  - {event: esc_end, source: "\\ufb01", dest: fi}
  - {event: esc_end, source: fi, dest: esc_done}
"""


def test_names_python_folds_together_stay_apart():
    # U+FB01 "\ufb01" is an identifier that Python folds to "fi" (NFKC): as parts of
    # generated function names the two states would share one function.
    spec = parse_spec(FOLDED, "folded.yaml")
    assert set(spec.states) == {"esc_start", "\ufb01", "fi", "esc_done"}
    table = TransferTable(Machine(spec, bindings_for(spec.name, {}), spec.default_config()))
    events = table.machine.event_classes
    table.dispatch(events["esc_begin"]("x", 0.0))
    assert table.dispatch(events["esc_go"]("x", 1.0, size=1)).state == "\ufb01"
    assert table.dispatch(events["esc_end"]("x", 2.0)).state == "fi"
    assert table.dispatch(events["esc_end"]("x", 3.0)).state == "esc_done"


def test_a_field_name_that_cannot_be_an_attribute_is_refused_by_name():
    spec = parse_spec(
        PLAIN.replace("payload: {size: int}", "payload: {class: int}")
        .replace("escaping_plain", "escaping_keyword")
        .replace("esc_go", "esc_go_kw"),
        "keyword.yaml",
    )
    machine = Machine(spec, bindings_for(spec.name, {}), spec.default_config())
    with pytest.raises(ValueError, match="field name 'class'"):
        TransferTable(machine)


def test_a_duration_that_is_no_finite_number_is_refused_before_it_is_written():
    spec = parse_spec(PLAIN, "escaping.yaml")
    machine = Machine(spec, bindings_for(spec.name, {}), {"esc_wait_s": float("inf")})
    with pytest.raises(ValueError, match="a duration must be a finite number"):
        TransferTable(machine)

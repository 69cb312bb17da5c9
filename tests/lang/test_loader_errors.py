"""Every diagnostic the spec loader, validator and binder can give, one test each.

Each test starts from ``VALID``, a small sound spec, breaks one thing, loads it with
``load_spec`` and checks the reported ``file:line`` and the words a user needs: the
name involved and what was expected. Lines are found by a marker text in the broken
spec, so a test states *where* the defect is rather than a bare number.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from moriio_fsm.lang.errors import Problem, SpecError
from moriio_fsm.lang.loader import load_spec, parse_spec
from moriio_fsm.runtime.bindings import Bindings
from moriio_fsm.runtime.declared import emits

REPO = Path(__file__).resolve().parents[2]

# The peer is asked when the transfer starts waiting (the 'ask_peer' effect); a failed
# ask comes back from the adapter as 'ask_failed', and the timer is the backstop.
VALID = """\
name: mini
initial: idle
config:
  wait_s: {default: 5.0, doc: How long to wait for the peer.}
context:
  bits: {type: bitmap, initial: 0}
  count: {type: int, initial: 0}
  ready: {type: bool, initial: false}
states:
  idle: {doc: Created.}
  waiting: {doc: Waiting for the peer.}
  done: {final: true}
  failed: {final: true}
events:
  create: {origin: local, creates: true}
  reply: {origin: remote, payload: {value: int}}
  go: {origin: local}
  ask_failed: {origin: adapter, payload: {error: str}}
  timeout: {origin: timer}
guards:
  is_ready: {doc: The peer's reply is usable., reads: [ready]}
actions:
  init: Set the context up.
  ask: Ask the peer for its reply.
  record: {doc: Remember the reply., writes: [bits, count]}
emits:
  ask_peer: {doc: Send the question., fields: {count: int}, on_failure: ask_failed}
timers:
  wait:
    states: [waiting]
    duration: wait_s
    event: timeout
transitions:
  - {event: create, source: idle, internal: true, actions: [init]}
  - {event: go, source: idle, dest: waiting, actions: [ask], emits: [ask_peer]}
  - {event: reply, source: waiting, dest: done, guard: is_ready, actions: [record]}
  - {event: reply, source: waiting, internal: true, outcome: ignored}
  - {event: timeout, source: waiting, dest: failed}
  - {event: ask_failed, source: waiting, dest: failed}
invariants:
  count_matches: "count == popcount(bits)"
"""

# Transition rows of VALID, by index, for edits that replace or follow one of them.
T0 = "  - {event: create, source: idle, internal: true, actions: [init]}\n"
T1 = "  - {event: go, source: idle, dest: waiting, actions: [ask], emits: [ask_peer]}\n"
T2 = "  - {event: reply, source: waiting, dest: done, guard: is_ready, actions: [record]}\n"
T3 = "  - {event: reply, source: waiting, internal: true, outcome: ignored}\n"
T4 = "  - {event: timeout, source: waiting, dest: failed}\n"
T5 = "  - {event: ask_failed, source: waiting, dest: failed}\n"
NEXT = 6  # the index of the first row add_transitions appends


# -- helpers --------------------------------------------------------------------------------


def edit(old: str, new: str, text: str = VALID) -> str:
    """Replace the one occurrence of ``old`` in ``text``."""
    assert text.count(old) == 1, f"{old!r} occurs {text.count(old)} times"
    return text.replace(old, new)


def add_transitions(*rows: str, text: str = VALID) -> str:
    """Append transition rows (flow mappings) after the last one of VALID."""
    return edit(T5, T5 + "".join(f"  - {row}\n" for row in rows), text)


def add_state(line: str, text: str = VALID) -> str:
    """Declare one more state (``line`` is its YAML line) before 'done'."""
    return edit("  done: {final: true}\n", f"  {line}\n  done: {{final: true}}\n", text)


def line_of(text: str, marker: str) -> int:
    """The 1-based line of the one line of ``text`` containing ``marker``."""
    hits = [n for n, line in enumerate(text.splitlines(), 1) if marker in line]
    assert len(hits) == 1, f"marker {marker!r} is on lines {hits}"
    return hits[0]


def problems(tmp_path: Path, text: str) -> list[Problem]:
    """Load ``text`` as a spec file and return its problems (an empty list when sound)."""
    path = tmp_path / "mini.yaml"
    path.write_text(text, encoding="utf-8")
    try:
        load_spec(path)
    except SpecError as exc:
        assert exc.problems, "a SpecError must list at least one problem"
        for p in exc.problems:
            assert p.path == str(path)
        return exc.problems
    return []


def find(found: list[Problem], line: int, *words: str) -> Problem:
    """The problem at ``line`` whose message has every one of ``words``."""
    for p in found:
        if p.line == line and all(w in p.message for w in words):
            return p
    listing = "\n".join(f"  {p.line}: {p.message}" for p in found) or "  (none)"
    pytest.fail(f"no problem at line {line} with {words!r}; got:\n{listing}")


def only(found: list[Problem], line: int, *words: str) -> Problem:
    """Like ``find``, and the spec has no other problem."""
    p = find(found, line, *words)
    assert len(found) == 1, "expected one problem, got:\n" + "\n".join(map(str, found))
    return p


def test_the_minimal_spec_is_sound(tmp_path):
    assert problems(tmp_path, VALID) == []


def test_the_shipped_write_producer_spec_loads_without_problems():
    spec = load_spec(REPO / "specs" / "write_producer.yaml")
    assert spec.name == "write_producer"
    assert spec.initial in spec.states
    assert spec.final_states


# -- SpecError and Problem ------------------------------------------------------------------


def test_spec_error_str_is_one_path_line_message_line_per_problem():
    err = SpecError(
        [
            Problem("specs/a.yaml", 12, "unknown state 'x'"),
            Problem("specs/a.yaml", 30, "guard 'g' is declared but no transition uses it"),
        ]
    )
    assert str(err) == (
        "specs/a.yaml:12: unknown state 'x'\n"
        "specs/a.yaml:30: guard 'g' is declared but no transition uses it"
    )
    assert isinstance(err, ValueError)


def test_spec_error_from_a_file_names_that_file_and_line(tmp_path):
    text = edit("initial: idle", "initial: idel")
    path = tmp_path / "mini.yaml"
    path.write_text(text)
    with pytest.raises(SpecError) as info:
        load_spec(path)
    first = str(info.value).splitlines()[0]
    assert first.startswith(f"{path}:2: unknown state 'idel'")


def test_parse_spec_names_the_given_path():
    with pytest.raises(SpecError) as info:
        parse_spec(edit("initial: idle", "initial: idel"), "specs/x.yaml")
    assert str(info.value).startswith("specs/x.yaml:2: ")


def test_unreadable_file_is_a_spec_error_not_an_os_error(tmp_path):
    missing = tmp_path / "nope.yaml"
    with pytest.raises(SpecError) as info:
        load_spec(missing)
    (p,) = info.value.problems
    assert p.path == str(missing) and p.line == 0
    assert "cannot read spec" in p.message


# -- YAML itself ----------------------------------------------------------------------------


def test_invalid_yaml_syntax_reports_the_line(tmp_path):
    text = edit(T1, T1.replace("}\n", "\n"))
    (p,) = problems(tmp_path, text)
    # The flow mapping is left open; the parser notices at the next item.
    assert p.line == line_of(text, "event: reply, source: waiting, dest: done")
    assert p.message.startswith("invalid YAML:")


def test_tab_indentation_is_invalid_yaml_at_its_line(tmp_path):
    text = edit("  waiting: {doc", "\twaiting: {doc")
    only(problems(tmp_path, text), line_of(text, "\twaiting"), "invalid YAML")


def test_control_character_is_invalid_yaml_at_its_line(tmp_path):
    text = edit("  go: {origin: local}", "  go: {origin: local}\x00")
    only(problems(tmp_path, text), line_of(text, "\x00"), "invalid YAML", "'\\x00'", "not allowed")


def test_second_document_is_invalid_yaml(tmp_path):
    text = VALID + "---\nname: other\n"
    only(problems(tmp_path, text), line_of(text, "---"), "invalid YAML")


def test_list_as_mapping_key_is_invalid_yaml(tmp_path):
    text = VALID + "? [a, b]\n: 1\n"
    only(problems(tmp_path, text), line_of(text, "? [a, b]"), "invalid YAML", "keys must be names")


def test_duplicate_state_key(tmp_path):
    text = edit("  done: {final: true}\n", "  done: {final: true}\n  idle: {}\n")
    second = [n for n, line in enumerate(text.splitlines(), 1) if line.startswith("  idle:")][1]
    only(problems(tmp_path, text), second, "duplicate key 'idle'")


def test_duplicate_top_level_key(tmp_path):
    text = VALID + "initial: waiting\n"
    only(problems(tmp_path, text), line_of(text, "initial: waiting"), "duplicate key 'initial'")


@pytest.mark.parametrize("text", ["", "~\n", "# only a comment\n"])
def test_empty_or_null_document(tmp_path, text):
    only(problems(tmp_path, text), 1, "must be a YAML mapping")


def test_list_document(tmp_path):
    only(problems(tmp_path, "- name: mini\n- initial: idle\n"), 1, "must be a YAML mapping")


# -- top-level shape ------------------------------------------------------------------------


def test_unknown_top_level_key(tmp_path):
    text = VALID + "transition: []\n"
    only(
        problems(tmp_path, text),
        line_of(text, "transition: []"),
        "unknown top-level key 'transition'",
        "transitions",
    )


def test_effects_section_of_the_old_format_says_what_replaced_it(tmp_path):
    text = VALID + "effects:\n  record: Remember the reply.\n"
    only(
        problems(tmp_path, text),
        line_of(text, "effects:"),
        "'effects' is not a section",
        "'actions'",
        "'writes'",
        "'emits'",
        "'fields'",
    )


def test_missing_name(tmp_path):
    only(problems(tmp_path, edit("name: mini\n", "")), 1, "missing or empty 'name'")


@pytest.mark.parametrize("section", ["states", "events"])
def test_missing_required_section(tmp_path, section):
    # Drop the whole section: its header and every indented line under it.
    lines = VALID.splitlines(keepends=True)
    head = lines.index(f"{section}:\n")
    tail = head + 1
    while tail < len(lines) and lines[tail].startswith("  "):
        tail += 1
    text = "".join(lines[:head] + lines[tail:])
    found = problems(tmp_path, text)
    find(found, 1, f"missing section {section!r}", "mapping")


def test_missing_transitions(tmp_path):
    text = VALID[: VALID.index("transitions:\n")] + VALID[VALID.index("invariants:\n") :]
    found = problems(tmp_path, text)
    find(found, 1, "missing 'transitions'", "list")


def test_states_given_as_a_list(tmp_path):
    text = edit(
        "  idle: {doc: Created.}\n  waiting: {doc: Waiting for the peer.}\n"
        "  done: {final: true}\n  failed: {final: true}\n",
        "  - idle\n  - waiting\n  - done\n  - failed\n",
    )
    found = problems(tmp_path, text)
    p = find(found, text.splitlines().index("states:") + 1, "'states' must be a mapping, got list")
    assert "_Line" not in p.message


def test_transitions_given_as_a_mapping(tmp_path):
    text = (
        VALID[: VALID.index("transitions:\n")]
        + "transitions:\n  create: idle\n"
        + VALID[VALID.index("invariants:\n") :]
    )
    found = problems(tmp_path, text)
    find(found, line_of(text, "transitions:"), "'transitions' must be a list, got mapping")


def test_transitions_list_of_scalars(tmp_path):
    text = VALID[: VALID.index(T0)] + "  - create\n  - go\n" + VALID[VALID.index("invariants:\n") :]
    found = problems(tmp_path, text)
    find(found, line_of(text, "- create"), "transition #0 must be a mapping")
    find(found, line_of(text, "- go"), "transition #1 must be a mapping")


# -- guards, actions and emits: their declarations --------------------------------------------


def test_guard_doc_must_be_text(tmp_path):
    text = edit("{doc: The peer's reply is usable., reads: [ready]}", "{doc: [x], reads: [ready]}")
    only(
        problems(tmp_path, text),
        line_of(text, "is_ready: {doc"),
        "guard 'is_ready' doc must be text, got list",
    )


def test_guard_that_is_neither_a_doc_nor_a_mapping(tmp_path):
    text = edit("{doc: The peer's reply is usable., reads: [ready]}", "[ready]")
    found = problems(tmp_path, text)
    find(
        found,
        line_of(text, "is_ready: [ready]"),
        "guard 'is_ready' must be a doc string or a mapping with doc and reads",
        "got list",
    )


def test_unknown_key_in_an_action_entry(tmp_path):
    text = edit("writes: [bits, count]}", "writes: [bits, count], emits: [ask_peer]}")
    only(
        problems(tmp_path, text),
        line_of(text, "record: {doc"),
        "action 'record': unknown key 'emits'",
        "expected doc, writes",
    )


def test_guard_reads_an_unknown_field(tmp_path):
    text = edit("reads: [ready]", "reads: [ready, redy]")
    only(
        problems(tmp_path, text),
        line_of(text, "reads: [ready, redy]"),
        "guard 'is_ready' reads 'redy'",
        "neither a context field nor a config key",
    )


def test_guard_may_read_a_config_key(tmp_path):
    assert problems(tmp_path, edit("reads: [ready]", "reads: [ready, wait_s]")) == []


@pytest.mark.parametrize("name, why", [("cnt", "unknown"), ("wait_s", "a config key")])
def test_action_writes_something_that_is_not_a_context_field(tmp_path, name, why):
    text = edit("writes: [bits, count]", f"writes: [bits, {name}]")
    only(
        problems(tmp_path, text),
        line_of(text, "record: {doc"),
        f"action 'record' writes {name!r}",
        "not a context field",
    )


def test_emit_that_is_not_a_mapping(tmp_path):
    text = edit("emits:\n", "emits:\n  shout: Say it loud.\n")
    only(
        problems(tmp_path, text),
        line_of(text, "shout:"),
        "emit 'shout' must be a mapping with doc, fields and on_failure",
    )


def test_emit_field_with_an_unknown_type(tmp_path):
    text = edit("fields: {count: int}", "fields: {count: integer}")
    only(
        problems(tmp_path, text),
        line_of(text, "ask_peer: {doc"),
        "emit 'ask_peer': field 'count' has unknown type 'integer'",
        "int, float, str, bool, list, tuple, any",
    )


def test_emit_fields_must_map_names_to_types(tmp_path):
    text = edit("fields: {count: int}", "fields: [count]")
    only(
        problems(tmp_path, text),
        line_of(text, "ask_peer: {doc"),
        "emit 'ask_peer': fields must map field names to type names",
    )


def test_emit_on_failure_names_an_unknown_event(tmp_path):
    text = edit("on_failure: ask_failed", "on_failure: ask_fialed")
    only(
        problems(tmp_path, text),
        line_of(text, "ask_peer: {doc"),
        "emit 'ask_peer': on_failure names unknown event 'ask_fialed'",
    )


# -- config and context ---------------------------------------------------------------------


def test_config_key_without_default(tmp_path):
    text = edit("{default: 5.0, doc: How long to wait for the peer.}", "{doc: no default}")
    found = problems(tmp_path, text)
    find(found, line_of(text, "wait_s: {doc"), "config key 'wait_s'", "'default'")


def test_context_field_with_unknown_type(tmp_path):
    text = edit("count: {type: int,", "count: {type: integer,")
    found = problems(tmp_path, text)
    find(
        found,
        line_of(text, "count: {type"),
        "context field 'count' needs a type",
        "int, bool, float, str, bitmap, object",
        "'integer'",
    )


def test_context_field_type_that_is_a_list(tmp_path):
    text = edit("count: {type: int,", "count: {type: [int],")
    found = problems(tmp_path, text)
    find(found, line_of(text, "count: {type"), "context field 'count' needs a type")


@pytest.mark.parametrize(
    "field, old, new, value, ftype",
    [
        (
            "count",
            "count: {type: int, initial: 0}",
            "count: {type: int, initial: zero}",
            "'zero'",
            "int",
        ),
        (
            "count",
            "count: {type: int, initial: 0}",
            "count: {type: int, initial: true}",
            "True",
            "int",
        ),
        (
            "bits",
            "bits: {type: bitmap, initial: 0}",
            "bits: {type: bitmap, initial: 1.5}",
            "1.5",
            "bitmap",
        ),
        (
            "ready",
            "ready: {type: bool, initial: false}",
            "ready: {type: bool, initial: 0}",
            "0",
            "bool",
        ),
    ],
)
def test_context_initial_value_of_the_wrong_type(tmp_path, field, old, new, value, ftype):
    text = edit(old, new)
    only(
        problems(tmp_path, text),
        line_of(text, f"{field}: {{type"),
        f"context field {field!r}",
        f"initial value {value}",
        f"not of type {ftype}",
    )


# -- states and events ----------------------------------------------------------------------


def test_final_flag_must_be_a_boolean(tmp_path):
    text = edit("  done: {final: true}", "  done: {final: 'yes'}")
    only(
        problems(tmp_path, text),
        line_of(text, "done: {final"),
        "state 'done'",
        "'final' must be true or false",
        "'yes'",
    )


def test_anomaly_on_a_state_that_is_not_final(tmp_path):
    text = edit(
        "  waiting: {doc: Waiting for the peer.}", "  waiting: {doc: Stuck., anomaly: true}"
    )
    only(
        problems(tmp_path, text),
        line_of(text, "waiting: {doc"),
        "state 'waiting' is marked anomaly but is not final",
        "only a final state",
    )


def test_anomaly_on_a_final_state_is_sound(tmp_path):
    text = edit("  failed: {final: true}", "  failed: {final: true, anomaly: true}")
    assert problems(tmp_path, text) == []


def test_unknown_key_in_a_state(tmp_path):
    text = edit("  done: {final: true}", "  done: {final: true, terminal: true}")
    only(
        problems(tmp_path, text),
        line_of(text, "done: {final"),
        "state 'done': unknown key 'terminal'",
        "expected doc, final, anomaly",
    )


def test_event_with_unknown_origin(tmp_path):
    text = edit("go: {origin: local}", "go: {origin: locale}")
    only(
        problems(tmp_path, text),
        line_of(text, "go: {origin"),
        "event 'go'",
        "origin must be one of local, adapter, remote, timer",
        "'locale'",
    )


def test_event_payload_must_map_names_to_types(tmp_path):
    text = edit("payload: {value: int}", "payload: [value]")
    only(
        problems(tmp_path, text),
        line_of(text, "reply: {origin"),
        "event 'reply'",
        "payload must map field names to types",
    )


def test_payload_default_of_the_wrong_type(tmp_path):
    text = edit("payload: {value: int}", "payload: {value: {type: int, default: seven}}")
    only(
        problems(tmp_path, text),
        line_of(text, "reply: {origin"),
        "event 'reply': payload field 'value'",
        "default 'seven' is not of type int",
    )


def test_payload_default_true_is_not_an_int(tmp_path):
    text = edit("payload: {value: int}", "payload: {value: {type: int, default: true}}")
    only(
        problems(tmp_path, text),
        line_of(text, "reply: {origin"),
        "payload field 'value'",
        "default True is not of type int",
    )


def test_payload_field_with_a_default_is_sound(tmp_path):
    text = edit("payload: {value: int}", "payload: {value: {type: int, default: 0}}")
    assert problems(tmp_path, text) == []


def test_required_payload_field_after_a_defaulted_one(tmp_path):
    text = edit(
        "  reply: {origin: remote, payload: {value: int}}\n",
        "  reply:\n    origin: remote\n    payload:\n      value: {type: int, default: 0}\n"
        "      extra: int\n",
    )
    only(
        problems(tmp_path, text),
        line_of(text, "extra: int"),
        "event 'reply': payload field 'extra' has no default",
        "comes after one that has",
        "list required fields first",
    )


def test_unknown_key_in_a_payload_field(tmp_path):
    text = edit("payload: {value: int}", "payload: {value: {type: int, dflt: 0}}")
    only(
        problems(tmp_path, text),
        line_of(text, "reply: {origin"),
        "payload field 'value': unknown key(s) dflt",
        "expected type and default",
    )


@pytest.mark.parametrize("name", ["transfer_id", "time", "source", "kind", "data"])
def test_payload_field_may_not_take_an_event_attribute_name(tmp_path, name):
    text = edit("payload: {value: int}", f"payload: {{value: int, {name}: str}}")
    only(
        problems(tmp_path, text),
        line_of(text, "reply: {origin"),
        f"event 'reply': payload field name {name!r}",
        "identifier other than data, kind, source, time, transfer_id",
    )


def test_creating_event_with_remote_origin(tmp_path):
    text = edit("reply: {origin: remote,", "reply: {origin: remote, creates: true,")
    found = problems(tmp_path, text)
    find(
        found,
        line_of(text, "reply: {origin"),
        "event 'reply' creates transfers",
        "origin is 'remote'",
        "only local events may create",
    )


def test_creates_must_be_a_boolean(tmp_path):
    text = edit(
        "create: {origin: local, creates: true}", "create: {origin: local, creates: 'false'}"
    )
    only(
        problems(tmp_path, text),
        line_of(text, "create: {origin"),
        "event 'create'",
        "'creates' must be true or false",
        "'false'",
    )


def test_no_creating_event(tmp_path):
    text = edit("create: {origin: local, creates: true}", "create: {origin: local}")
    only(problems(tmp_path, text), 1, "no event is marked 'creates: true'")


def test_creating_event_not_handled_in_the_initial_state(tmp_path):
    text = edit(
        "  go: {origin: local}\n",
        "  go: {origin: local}\n  spawn: {origin: local, creates: true}\n",
    )
    text = add_transitions("{event: spawn, source: waiting, internal: true}", text=text)
    only(
        problems(tmp_path, text),
        line_of(text, "spawn: {origin"),
        "creating event 'spawn'",
        "no transition from initial state 'idle'",
    )


# -- unknown names --------------------------------------------------------------------------


def test_unknown_initial_state(tmp_path):
    text = edit("initial: idle", "initial: idel")
    only(
        problems(tmp_path, text),
        2,
        "unknown state 'idel' given as initial",
        "known states: idle, waiting, done, failed",
    )


def test_missing_initial_state(tmp_path):
    text = edit("initial: idle\n", "")
    only(problems(tmp_path, text), 1, "missing 'initial'", "name of the initial state")


def test_unknown_source_state(tmp_path):
    text = edit(T1, T1.replace("source: idle", "source: idel"))
    only(
        problems(tmp_path, text),
        line_of(text, "source: idel"),
        "unknown state 'idel' in transition #1 source",
        "known states: idle, waiting, done, failed",
    )


def test_unknown_source_state_in_a_multi_line_list_points_at_its_item(tmp_path):
    text = edit(
        T1,
        "  - event: go\n    source:\n      - idle\n      - idel\n    dest: waiting\n"
        "    actions: [ask]\n    emits: [ask_peer]\n",
    )
    only(
        problems(tmp_path, text),
        line_of(text, "- idel"),
        "unknown state 'idel' in transition #1 source",
    )


def test_unknown_dest_state(tmp_path):
    text = edit(T4, "  - {event: timeout, source: waiting, dest: fialed}\n")
    only(
        problems(tmp_path, text),
        line_of(text, "dest: fialed"),
        "unknown state 'fialed' in transition #4 dest",
        "known states:",
    )


def test_unknown_timer_state(tmp_path):
    text = edit("states: [waiting]", "states: [waiting, wating]")
    only(
        problems(tmp_path, text),
        line_of(text, "states: [waiting, wating]"),
        "unknown state 'wating' in timer 'wait'",
        "known states:",
    )


def test_unknown_event_in_transition(tmp_path):
    text = edit(T1, T1.replace("event: go", "event: og"))
    found = problems(tmp_path, text)
    find(
        found,
        line_of(text, "event: og"),
        "unknown event 'og' in transition #1",
        "known events: create, reply, go, ask_failed, timeout",
    )


def test_unknown_event_in_timer(tmp_path):
    text = edit("event: timeout\n", "event: timout\n")
    only(
        problems(tmp_path, text),
        line_of(text, "event: timout"),
        "unknown event 'timout' in timer 'wait'",
        "known events:",
    )


def test_unknown_event_in_timer_restart_on(tmp_path):
    text = edit("event: timeout\n", "event: timeout\n    restart_on: [rpely]\n")
    only(
        problems(tmp_path, text),
        line_of(text, "restart_on"),
        "unknown event 'rpely' in timer 'wait' restart_on",
    )


def test_unknown_guard(tmp_path):
    text = edit("guard: is_ready", "guard: is_redy")
    found = problems(tmp_path, text)
    find(
        found,
        line_of(text, "guard: is_redy"),
        "unknown guard 'is_redy' in transition #2",
        "declare it under 'guards'",
    )


def test_unknown_action(tmp_path):
    text = edit("actions: [record]", "actions: [recrod]")
    found = problems(tmp_path, text)
    find(
        found,
        line_of(text, "recrod"),
        "unknown action 'recrod' in transition #2",
        "declare it under 'actions'",
    )


def test_unknown_emit_in_a_row(tmp_path):
    text = edit("emits: [ask_peer]}", "emits: [ask_pear]}")
    found = problems(tmp_path, text)
    find(
        found,
        line_of(text, "ask_pear"),
        "unknown emit 'ask_pear' in transition #1",
        "declare it under 'emits'",
    )


# -- malformed transitions ------------------------------------------------------------------


def test_unknown_transition_key(tmp_path):
    text = edit(T1, T1.replace("}\n", ", gaurd: is_ready}\n"))
    only(
        problems(tmp_path, text),
        line_of(text, "gaurd"),
        "transition #1: unknown key 'gaurd'",
        "actions, dest, emits, event, guard, internal, outcome, source",
    )


def test_effects_key_of_the_old_format_in_a_row_says_what_replaced_it(tmp_path):
    text = edit(T2, T2.replace("actions: [record]", "effects: [record]"))
    found = problems(tmp_path, text)
    find(
        found,
        line_of(text, "effects: [record]"),
        "transition #2: 'effects' is split into "
        "'actions' (context updates) and 'emits' (effect kinds)",
    )


@pytest.mark.parametrize(
    "key, value", [("event", "[go]"), ("dest", "[waiting]"), ("guard", "[is_ready]")]
)
def test_transition_name_given_as_a_list(tmp_path, key, value):
    row = {
        "event": "go",
        "source": "idle",
        "dest": "waiting",
        "actions": "[ask]",
        "emits": "[ask_peer]",
    }
    row[key] = value
    text = edit(T1, "  - {" + ", ".join(f"{k}: {v}" for k, v in row.items()) + "}\n")
    found = problems(tmp_path, text)
    find(found, line_of(text, "event: " + row["event"]), f"transition #1 {key} must be a name")


def test_actions_that_are_not_names(tmp_path):
    text = edit("actions: [record]", "actions: 5")
    found = problems(tmp_path, text)
    find(
        found,
        line_of(text, "actions: 5"),
        "transition #2 actions must be a name or a non-empty list",
    )


def test_an_action_listed_twice_in_a_row(tmp_path):
    text = edit("actions: [record]", "actions: [record, record]")
    only(
        problems(tmp_path, text),
        line_of(text, "actions: [record, record]"),
        "transition #2 lists a action twice in actions",
    )


def test_emits_without_actions(tmp_path):
    text = edit(T3, "  - {event: reply, source: waiting, internal: true, emits: [ask_peer]}\n")
    only(
        problems(tmp_path, text),
        line_of(text, "internal: true, emits: [ask_peer]"),
        "transition #3 lists emits but no action",
        "effects are emitted by actions",
    )


def test_source_must_not_be_empty(tmp_path):
    text = edit(T1, T1.replace("source: idle", "source: []"))
    only(
        problems(tmp_path, text),
        line_of(text, "source: []"),
        "transition #1 source must be a name or a non-empty list of names",
    )


def test_internal_transition_that_also_names_a_dest(tmp_path):
    text = edit(
        T0, "  - {event: create, source: idle, internal: true, dest: idle, actions: [init]}\n"
    )
    only(
        problems(tmp_path, text),
        line_of(text, "event: create"),
        "transition #0 is internal and also names dest 'idle'",
    )


def test_transition_without_dest_or_internal(tmp_path):
    text = edit(T0, "  - {event: create, source: idle, actions: [init]}\n")
    only(
        problems(tmp_path, text),
        line_of(text, "event: create"),
        "transition #0 needs a 'dest' state or 'internal: true'",
    )


def test_internal_must_be_a_boolean(tmp_path):
    text = edit(T3, "  - {event: reply, source: waiting, internal: 'no', outcome: ignored}\n")
    found = problems(tmp_path, text)
    find(
        found, line_of(text, "internal: 'no'"), "transition #3", "'internal' must be true or false"
    )


def test_eventless_internal_transition(tmp_path):
    text = add_transitions("{source: waiting, internal: true, guard: is_ready}")
    only(
        problems(tmp_path, text),
        line_of(text, "{source: waiting, internal: true"),
        f"transition #{NEXT} is eventless and internal",
        "must change state",
    )


def test_unknown_outcome(tmp_path):
    text = edit("outcome: ignored", "outcome: dropped")
    only(
        problems(tmp_path, text),
        line_of(text, "outcome: dropped"),
        "transition #3: outcome must be one of applied, duplicate, ignored",
        "'dropped'",
    )


def test_outcome_on_a_transition_with_actions(tmp_path):
    text = edit(
        T0,
        "  - {event: create, source: idle, internal: true, actions: [init], outcome: duplicate}\n",
    )
    only(
        problems(tmp_path, text),
        line_of(text, "event: create"),
        "transition #0 declares outcome 'duplicate'",
        "only for internal transitions without actions or emits",
    )


def test_outcome_on_a_state_changing_transition(tmp_path):
    text = edit(T4, "  - {event: timeout, source: waiting, dest: failed, outcome: ignored}\n")
    only(
        problems(tmp_path, text),
        line_of(text, "dest: failed, outcome: ignored"),
        "transition #4 declares outcome 'ignored'",
        "only for internal transitions",
    )


# -- timers ---------------------------------------------------------------------------------


def test_timer_duration_not_a_config_key(tmp_path):
    text = edit("duration: wait_s", "duration: 5.0")
    only(
        problems(tmp_path, text),
        line_of(text, "duration:"),
        "timer 'wait': duration must name a config key",
        "got 5.0",
        "known: wait_s",
    )


def test_timer_duration_given_as_a_list(tmp_path):
    text = edit("duration: wait_s", "duration: [wait_s]")
    only(
        problems(tmp_path, text),
        line_of(text, "duration:"),
        "timer 'wait': duration must name a config key",
    )


def test_timer_event_whose_origin_is_not_timer(tmp_path):
    text = edit("event: timeout\n", "event: go\n")
    found = problems(tmp_path, text)
    find(
        found,
        line_of(text, "    event: go"),
        "timer 'wait' fires event 'go'",
        "origin must be 'timer'",
    )


def test_timer_without_event(tmp_path):
    text = edit("    event: timeout\n", "")
    found = problems(tmp_path, text)
    find(found, line_of(text, "  wait:"), "timer 'wait' needs the 'event' it fires")


def test_timer_that_is_not_a_mapping(tmp_path):
    text = edit("    event: timeout\n", "    event: timeout\n  other: 5\n")
    only(
        problems(tmp_path, text),
        line_of(text, "other: 5"),
        "timer 'other' must be a mapping",
        "states, duration and event",
    )


def test_timer_on_a_final_state(tmp_path):
    text = edit("states: [waiting]", "states: [waiting, done]")
    only(
        problems(tmp_path, text),
        line_of(text, "  wait:"),
        "timer 'wait' is armed in final state 'done'",
    )


def test_a_timer_needs_a_row_for_its_event_in_every_armed_state(tmp_path):
    text = edit("    states: [waiting]\n", "    states: [idle, waiting]\n")
    only(
        problems(tmp_path, text),
        line_of(text, "  wait:"),
        "timer 'wait' is armed in state 'idle'",
        "no transition handles its event 'timeout'",
    )


def test_a_timer_whose_rows_in_an_armed_state_are_all_guarded(tmp_path):
    # Rule A: when no guard holds the firing is rejected and the timer is gone.
    text = edit(T4, "  - {event: timeout, source: waiting, dest: failed, guard: is_ready}\n")
    only(
        problems(tmp_path, text),
        line_of(text, "event: timeout, source: waiting"),
        "timer 'wait' fires 'timeout' in state 'waiting' where every row has a guard",
        "'is_ready'",
        "end with an unguarded row",
    )


def test_a_guarded_timer_row_followed_by_an_unguarded_one_is_sound(tmp_path):
    text = edit(
        T4,
        "  - {event: timeout, source: waiting, dest: failed, guard: is_ready}\n"
        "  - {event: timeout, source: waiting, dest: done}\n",
    )
    assert problems(tmp_path, text) == []


# -- structure: reachability, ways out, finals ----------------------------------------------


def test_unreachable_state(tmp_path):
    text = add_transitions("{event: go, source: limbo, dest: done}", text=add_state("limbo: {}"))
    only(
        problems(tmp_path, text),
        line_of(text, "limbo: {}"),
        "unreachable state 'limbo'",
        "from initial state 'idle'",
    )


def test_non_final_state_with_no_way_out(tmp_path):
    text = add_transitions("{event: go, source: waiting, dest: stuck}", text=add_state("stuck: {}"))
    only(
        problems(tmp_path, text),
        line_of(text, "stuck: {}"),
        "non-final state 'stuck' has no way out",
        "no transition leaves it",
    )


def test_non_final_states_that_cannot_reach_a_final_state(tmp_path):
    text = add_state("pong: {}", text=add_state("ping: {}"))
    text = add_transitions(
        "{event: go, source: waiting, dest: ping}",
        "{event: go, source: ping, dest: pong}",
        "{event: go, source: pong, dest: ping}",
        text=text,
    )
    found = problems(tmp_path, text)
    find(found, line_of(text, "ping: {}"), "non-final state 'ping' can never reach a final state")
    find(found, line_of(text, "pong: {}"), "non-final state 'pong' can never reach a final state")
    assert len(found) == 2


def test_state_only_peer_messages_can_leave(tmp_path):
    text = add_transitions(
        "{event: go, source: waiting, dest: asking}",
        "{event: reply, source: asking, dest: done}",
        text=add_state("asking: {}"),
    )
    only(
        problems(tmp_path, text),
        line_of(text, "asking: {}"),
        "state 'asking' waits only on peers or adapters",
        "arm a timer in it",
    )


def test_state_only_an_adapter_can_leave(tmp_path):
    # An adapter's report is no backstop: the adapter may never report.
    text = add_transitions(
        "{event: go, source: waiting, dest: asking}",
        "{event: ask_failed, source: asking, dest: failed}",
        text=add_state("asking: {}"),
    )
    only(
        problems(tmp_path, text),
        line_of(text, "asking: {}"),
        "state 'asking' waits only on peers or adapters",
    )


def test_state_only_peer_messages_can_leave_despite_a_local_internal_transition(tmp_path):
    # A local event that keeps the state is no way out: the transfer still hangs if
    # the peer never answers.
    text = add_transitions(
        "{event: go, source: waiting, dest: asking}",
        "{event: reply, source: asking, dest: done}",
        "{event: go, source: asking, internal: true, outcome: ignored}",
        text=add_state("asking: {}"),
    )
    only(
        problems(tmp_path, text),
        line_of(text, "asking: {}"),
        "state 'asking' waits only on peers or adapters",
    )


def test_local_internal_row_writing_what_no_eventless_exit_reads_is_no_backstop(tmp_path):
    # 'go' in 'asking' runs 'record' (writes bits, count), but the eventless exit's guard
    # reads only 'ready': the local event can never enable that exit.
    text = add_transitions(
        "{event: go, source: waiting, dest: asking}",
        "{event: go, source: asking, internal: true, actions: [record]}",
        "{source: asking, dest: done, guard: is_ready}",
        text=add_state("asking: {}"),
    )
    only(
        problems(tmp_path, text),
        line_of(text, "asking: {}"),
        "state 'asking' waits only on peers or adapters",
    )


def test_local_internal_row_writing_what_an_eventless_exit_reads_is_a_backstop(tmp_path):
    # The same shape as above, but now 'record' writes 'ready', which the exit reads.
    text = edit("writes: [bits, count]", "writes: [bits, count, ready]")
    text = add_transitions(
        "{event: go, source: waiting, dest: asking}",
        "{event: go, source: asking, internal: true, actions: [record]}",
        "{source: asking, dest: done, guard: is_ready}",
        text=add_state("asking: {}", text=text),
    )
    assert problems(tmp_path, text) == []


def test_timers_that_only_lead_to_more_waiting_are_no_way_to_an_end(tmp_path):
    # 'a' and 'b' each have a timer that leaves into the other: every state has a
    # backstop, yet without the peer a transfer bounces between them forever.
    text = VALID.replace(
        "  timeout: {origin: timer}\n",
        "  timeout: {origin: timer}\n  tick_a: {origin: timer}\n  tick_b: {origin: timer}\n",
    )
    text = text.replace(
        "timers:\n",
        "timers:\n  ta: {states: [ping], duration: wait_s, event: tick_a}\n"
        "  tb: {states: [pong], duration: wait_s, event: tick_b}\n",
    )
    text = add_transitions(
        "{event: go, source: waiting, dest: ping}",
        "{event: tick_a, source: ping, dest: pong}",
        "{event: tick_b, source: pong, dest: ping}",
        "{event: reply, source: [ping, pong], dest: done}",
        text=add_state("pong: {}", text=add_state("ping: {}", text=text)),
    )
    found = problems(tmp_path, text)
    find(found, line_of(text, "ping: {}"), "state 'ping' cannot end without a peer or an adapter")
    find(found, line_of(text, "pong: {}"), "state 'pong' cannot end without a peer or an adapter")
    assert len(found) == 2


def test_a_timer_the_peer_keeps_restarting_is_no_backstop(tmp_path):
    # The only way out of 'waiting' is its timer, and every applied reply restarts it:
    # a peer that keeps replying keeps the transfer waiting forever.
    text = edit("    event: timeout\n", "    event: timeout\n    restart_on: [reply]\n")
    text = edit(
        T3, "  - {event: reply, source: waiting, internal: true, actions: [record]}\n", text
    )
    text = edit(T5, "", text)
    text = text.replace(
        "emits:\n  ask_peer: {doc: Send the question., fields: {count: int}, on_failure: ask_failed}\n",
        "",
    )
    text = text.replace(", emits: [ask_peer]", "").replace(
        "  ask: Ask the peer for its reply.\n", ""
    )
    text = text.replace("actions: [ask]", "").replace(
        "  ask_failed: {origin: adapter, payload: {error: str}}\n", ""
    )
    text = text.replace(", dest: waiting, }", ", dest: waiting}")
    found = problems(tmp_path, text)
    find(
        found,
        line_of(text, "waiting: {doc: Waiting for the peer.}"),
        "state 'waiting' waits only on peers or adapters",
        "cannot keep postponing",
    )
    find(found, line_of(text, "idle: {doc: Created.}"), "state 'idle' cannot end without a peer")
    assert len(found) == 2


def test_final_state_with_an_outgoing_transition(tmp_path):
    text = add_transitions("{event: go, source: done, dest: failed}")
    only(
        problems(tmp_path, text),
        line_of(text, "source: done, dest: failed"),
        f"final state 'done' has an outgoing transition #{NEXT} (go from done)",
        "absorbing",
    )


def test_spec_without_a_final_state(tmp_path):
    text = edit("  done: {final: true}\n  failed: {final: true}\n", "  done: {}\n  failed: {}\n")
    found = problems(tmp_path, text)
    find(found, 1, "the spec has no final state")


# -- emits and their failures -----------------------------------------------------------------


def test_emit_without_on_failure_from_a_row_that_leaves_the_transfer_alive(tmp_path):
    text = edit(", on_failure: ask_failed}", "}")
    only(
        problems(tmp_path, text),
        line_of(text, "ask_peer: {doc"),
        "emit 'ask_peer' has no on_failure event",
        "leave the transfer alive in waiting",
    )


def test_emit_without_on_failure_from_rows_into_final_states_is_sound(tmp_path):
    # A failure after the transfer ended has nothing left to tell.
    text = edit(", on_failure: ask_failed}", "}")
    text = edit(T1, "  - {event: go, source: idle, dest: waiting, actions: [ask]}\n", text)
    text = edit(
        T2, T2.replace("actions: [record]", "actions: [record, ask], emits: [ask_peer]"), text
    )
    text = edit(T5, "", text)
    text = edit("  ask_failed: {origin: adapter, payload: {error: str}}\n", "", text)
    assert problems(tmp_path, text) == []


def test_on_failure_event_must_come_from_an_adapter(tmp_path):
    text = edit("ask_failed: {origin: adapter,", "ask_failed: {origin: local,")
    only(
        problems(tmp_path, text),
        line_of(text, "ask_peer: {doc"),
        "emit 'ask_peer': on_failure event 'ask_failed' must have origin 'adapter'",
        "not 'local'",
    )


def test_on_failure_payload_field_the_emit_does_not_carry(tmp_path):
    text = edit("payload: {error: str}", "payload: {error: str, layer: int}")
    only(
        problems(tmp_path, text),
        line_of(text, "ask_peer: {doc"),
        "emit 'ask_peer': on_failure event 'ask_failed' declares payload field(s) layer",
        "the effect does not carry",
        "'error'",
    )


def test_on_failure_payload_may_repeat_the_emits_fields(tmp_path):
    text = edit("payload: {error: str}", "payload: {error: str, count: int}")
    assert problems(tmp_path, text) == []


def test_on_failure_event_not_handled_where_the_emit_leaves_the_transfer(tmp_path):
    # 'create' now asks too, and stays in 'idle', where no row takes 'ask_failed'.
    text = edit(
        T0,
        "  - {event: create, source: idle, internal: true, actions: [init, ask], "
        "emits: [ask_peer]}\n",
    )
    only(
        problems(tmp_path, text),
        line_of(text, "ask_peer: {doc"),
        "emit 'ask_peer': its on_failure event 'ask_failed' is not handled in state 'idle'",
    )


# -- transitions that no guard separates ----------------------------------------------------


def test_second_transition_after_an_unguarded_one_can_never_fire(tmp_path):
    text = add_transitions("{event: timeout, source: waiting, dest: done}")
    only(
        problems(tmp_path, text),
        line_of(text, "event: timeout, source: waiting, dest: done"),
        f"transitions #4 and #{NEXT} both handle event 'timeout' in state 'waiting'",
        "the first has no guard",
        f"#{NEXT} can never fire",
    )


def test_two_transitions_with_the_same_guard(tmp_path):
    text = edit(T2, T2 + "  - {event: reply, source: waiting, dest: failed, guard: is_ready}\n")
    found = problems(tmp_path, text)
    line = line_of(text, "dest: failed, guard: is_ready")
    find(
        found,
        line,
        "transitions #2 and #3 both handle event 'reply' in state 'waiting'",
        "both use guard 'is_ready'",
        "#3 can never fire",
    )
    assert len(found) == 1


def test_two_unguarded_eventless_transitions_from_one_state(tmp_path):
    text = add_transitions("{source: waiting, dest: done}", "{source: waiting, dest: failed}")
    found = problems(tmp_path, text)
    find(
        found,
        line_of(text, "{source: waiting, dest: failed}"),
        f"transitions #{NEXT} and #{NEXT + 1} both handle eventless step in state 'waiting'",
        "the first has no guard",
    )


def test_eventless_cycle(tmp_path):
    text = add_transitions(
        "{source: waiting, dest: idle, guard: is_ready}",
        "{source: idle, dest: waiting, guard: is_ready}",
    )
    only(
        problems(tmp_path, text),
        line_of(text, "idle: {doc"),
        "eventless transitions form a cycle: idle -> waiting -> idle",
    )


def test_eventless_self_loop(tmp_path):
    text = add_transitions("{source: waiting, dest: waiting, guard: is_ready}")
    only(
        problems(tmp_path, text),
        line_of(text, "waiting: {doc"),
        "eventless transitions form a cycle: waiting -> waiting",
    )


# -- names declared and never used ----------------------------------------------------------


def test_unused_guard(tmp_path):
    text = edit("guards:\n", "guards:\n  spare: Never used.\n")
    only(
        problems(tmp_path, text),
        line_of(text, "spare:"),
        "guard 'spare' is declared but no transition uses it",
    )


def test_unused_action(tmp_path):
    text = edit("actions:\n", "actions:\n  spare: Never used.\n")
    only(
        problems(tmp_path, text),
        line_of(text, "spare:"),
        "action 'spare' is declared but no transition uses it",
    )


def test_unused_emit(tmp_path):
    text = edit("emits:\n", "emits:\n  spare: {doc: Never used., fields: {count: int}}\n")
    only(
        problems(tmp_path, text),
        line_of(text, "spare:"),
        "emit 'spare' is declared but no transition uses it",
    )


def test_unused_event(tmp_path):
    text = edit("  go: {origin: local}\n", "  go: {origin: local}\n  spare: {origin: local}\n")
    only(
        problems(tmp_path, text),
        line_of(text, "spare:"),
        "event 'spare' is declared but no transition handles it",
    )


def test_event_used_only_by_a_timer_counts_as_used(tmp_path):
    text = edit(T4, "")
    found = problems(tmp_path, text)
    assert not any("'timeout' is declared" in p.message for p in found)


# -- invariants -----------------------------------------------------------------------------


def test_invariant_naming_an_unknown_field(tmp_path):
    text = edit('"count == popcount(bits)"', '"count == popcount(bitz)"')
    only(
        problems(tmp_path, text),
        line_of(text, "count_matches"),
        "invariant 'count_matches'",
        "names 'bitz', which is not a context field",
        "known fields: bits, count, ready",
    )


def test_invariant_may_name_the_state(tmp_path):
    text = edit('"count == popcount(bits)"', "\"count == popcount(bits) or state == 'failed'\"")
    assert problems(tmp_path, text) == []


def test_invariant_with_attribute_access(tmp_path):
    text = edit('"count == popcount(bits)"', '"count.__class__ == 0"')
    only(
        problems(tmp_path, text),
        line_of(text, "count_matches"),
        "invariant 'count_matches'",
        "uses Attribute, which is not allowed",
    )


def test_invariant_calling_import(tmp_path):
    text = edit('"count == popcount(bits)"', "\"__import__('os') == 0\"")
    only(
        problems(tmp_path, text),
        line_of(text, "count_matches"),
        "invariant 'count_matches'",
        "calls something other than abs, len, popcount",
    )


def test_invariant_with_a_syntax_error(tmp_path):
    text = edit('"count == popcount(bits)"', '"count =="')
    only(
        problems(tmp_path, text),
        line_of(text, "count_matches"),
        "invariant 'count_matches'",
        "invalid expression 'count =='",
    )


def test_invariant_that_is_not_a_string(tmp_path):
    text = edit('"count == popcount(bits)"', "[count]")
    only(
        problems(tmp_path, text),
        line_of(text, "count_matches"),
        "invariant 'count_matches' must be an expression string",
    )


# -- several problems at once ---------------------------------------------------------------


def test_all_problems_of_a_file_are_reported_together(tmp_path):
    text = edit("initial: idle", "initial: idel")
    text = edit("guard: is_ready", "guard: is_redy", text)
    found = problems(tmp_path, text)
    find(found, 2, "unknown state 'idel'")
    find(found, line_of(text, "is_redy"), "unknown guard 'is_redy'")


# -- bindings -------------------------------------------------------------------------------
# check() reads each binding's bytecode, so these are real functions, not lambdas made up
# from names: what they read, store and emit is what is checked.


def _is_ready(transfer, event):
    return transfer.ready


def _init(transfer, event, out):
    pass


def _ask(transfer, event, out):
    out.append(emits.ask_peer(transfer.transfer_id, count=transfer.count))


def _record(transfer, event, out):
    transfer.bits |= 1 << event.value
    transfer.count += 1


def _named(fn, name: str):
    """A copy of ``fn`` bound under ``name`` (Bindings keys functions by __name__)."""
    import types

    copy = types.FunctionType(fn.__code__, fn.__globals__, name, fn.__defaults__, fn.__closure__)
    return copy


GUARDS = {"is_ready": _is_ready}
ACTIONS = {"init": _init, "ask": _ask, "record": _record}


def _bindings(
    name: str = "mini", guards: dict | None = None, actions: dict | None = None
) -> Bindings:
    b = Bindings(name)
    for g, fn in (GUARDS if guards is None else guards).items():
        b.guard(_named(fn, g))
    for a, fn in (ACTIONS if actions is None else actions).items():
        b.action(_named(fn, a))
    return b


def _spec(text: str = VALID):
    return parse_spec(text, "mini.yaml")


def _binding_problems(bindings: Bindings, text: str = VALID) -> list[Problem]:
    with pytest.raises(SpecError) as info:
        bindings.check(_spec(text))
    for p in info.value.problems:
        assert p.path == "mini.yaml"
    return info.value.problems


def test_complete_bindings_pass():
    _bindings().check(_spec())


def test_bindings_missing_a_declared_guard():
    (p,) = _binding_problems(_bindings(guards={}))
    assert p.line == line_of(VALID, "is_ready: {doc")
    assert "guard 'is_ready' is declared in the spec but has no Python binding" in p.message
    assert "'mini' machine module" in p.message


def test_bindings_with_an_undeclared_action():
    (p,) = _binding_problems(_bindings(actions={**ACTIONS, "launch": _init}))
    assert p.line == 1
    assert "action 'launch' is bound in Python but not declared under 'actions'" in p.message


def test_bindings_for_another_spec():
    (p,) = _binding_problems(_bindings("other"))
    assert "spec is named 'mini' but the bindings are for 'other'" in p.message


def test_guard_binding_reading_an_undeclared_field():
    def is_ready(transfer, event):
        return transfer.ready and transfer.count > 0

    (p,) = _binding_problems(_bindings(guards={"is_ready": is_ready}))
    assert p.line == line_of(VALID, "is_ready: {doc")
    assert "guard 'is_ready' reads count but its spec entry declares reads: [ready]" in p.message


def test_guard_binding_that_assigns():
    def is_ready(transfer, event):
        transfer.ready = True
        return True

    found = _binding_problems(_bindings(guards={"is_ready": is_ready}))
    assert any("guard 'is_ready' assigns ready; a guard only reads" in p.message for p in found)


def test_action_binding_writing_an_undeclared_field():
    def record(transfer, event, out):
        transfer.bits |= 1 << event.value
        transfer.count += 1
        transfer.ready = True

    (p,) = _binding_problems(_bindings(actions={**ACTIONS, "record": record}))
    assert p.line == line_of(VALID, "record: {doc")
    assert (
        "action 'record' writes ready but its spec entry declares writes: [bits, count]"
        in p.message
    )


def test_action_binding_emitting_an_undeclared_kind():
    def ask(transfer, event, out):
        out.append(emits.ask_peer(transfer.transfer_id, count=transfer.count))
        out.append(emits.launch(transfer.transfer_id))

    (p,) = _binding_problems(_bindings(actions={**ACTIONS, "ask": ask}))
    assert p.line == line_of(VALID, "ask: Ask")
    assert "action 'ask' emits 'launch', which is not declared under 'emits'" in p.message


def test_row_missing_an_emit_its_action_builds():
    # 'record' now builds ask_peer, but the row running it (#2) does not list it.
    def record(transfer, event, out):
        transfer.bits |= 1 << event.value
        transfer.count += 1
        out.append(emits.ask_peer(transfer.transfer_id, count=transfer.count))

    (p,) = _binding_problems(_bindings(actions={**ACTIONS, "record": record}))
    assert p.line == line_of(VALID, T2.strip())
    assert (
        "transition #2 (reply from waiting) runs an action that emits 'ask_peer', but the "
        "row does not list it under emits"
    ) in p.message


def test_row_listing_an_emit_none_of_its_actions_builds():
    (p,) = _binding_problems(_bindings(actions={**ACTIONS, "ask": _init}))
    assert p.line == line_of(VALID, T1.strip())
    assert (
        "transition #1 (go from idle) lists emit 'ask_peer', but none of its actions (ask)"
        in p.message
    )


def test_binding_a_name_twice_is_refused():
    b = Bindings("mini")

    def is_ready(t, e):
        return True

    b.guard(is_ready)
    with pytest.raises(ValueError, match="guard 'is_ready' is bound twice for spec 'mini'"):
        b.guard(is_ready)


# -- names and config values --------------------------------------------------------------------


@pytest.mark.parametrize("name", ["state", "transfer_id", "deadlines", "config", "popcount", "_x"])
def test_context_fields_may_not_shadow_record_attributes(tmp_path, name):
    text = edit(
        "  count: {type: int, initial: 0}\n",
        f"  count: {{type: int, initial: 0}}\n  {name}: {{type: int, initial: 0}}\n",
    )
    find(problems(tmp_path, text), line_of(text, f"  {name}: {{type"), repr(name), "reserved")


def test_names_must_be_identifiers(tmp_path):
    text = add_state("not-a-name: {doc: Bad.}")
    find(problems(tmp_path, text), line_of(text, "not-a-name"), "'not-a-name'", "identifier")


def test_integer_state_names_are_a_problem_not_a_crash(tmp_path):
    text = add_state("7: {doc: Bad.}") + "  wrong: 1\n"
    found = problems(tmp_path, text)
    find(found, line_of(text, "  7: {doc"), "7", "identifier")


@pytest.mark.parametrize("default", ["thirty", "0", "-1.0", "true", ".nan"])
def test_config_defaults_must_be_positive_numbers(tmp_path, default):
    text = edit("wait_s: {default: 5.0,", f"wait_s: {{default: {default},")
    find(problems(tmp_path, text), line_of(text, "wait_s: {default"), "'wait_s'", "positive")


def test_a_context_field_needs_an_initial_value(tmp_path):
    text = edit("  count: {type: int, initial: 0}\n", "  count: {type: int}\n")
    find(problems(tmp_path, text), line_of(text, "  count: {type"), "'count'", "initial")


def test_context_field_and_config_key_may_not_share_a_name(tmp_path):
    text = edit(
        "  count: {type: int, initial: 0}\n",
        "  count: {type: int, initial: 0}\n  wait_s: {type: float, initial: 1.0}\n",
    )
    find(problems(tmp_path, text), line_of(text, "  wait_s: {type"), "'wait_s'", "config key")


def test_payload_types_must_be_known(tmp_path):
    text = edit("payload: {value: int}", "payload: {value: integr}")
    find(problems(tmp_path, text), line_of(text, "integr"), "'value'", "'integr'", "list")

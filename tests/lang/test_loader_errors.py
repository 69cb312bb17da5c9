"""Every diagnostic the spec loader, validator and binder can give, one test each.

Each test starts from ``VALID``, a small sound spec, breaks one thing, loads it with
``load_spec`` and checks the reported ``file:line`` and the words a user needs: the
name involved and what was expected. Lines are found by a marker text in the broken
spec, so a test states *where* the defect is rather than a bare number.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from moriio_fsm.machines.binding import Bindings
from moriio_fsm.lang.errors import Problem, SpecError
from moriio_fsm.lang.loader import load_spec, parse_spec

REPO = Path(__file__).resolve().parents[2]

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
  timeout: {origin: timer}
guards:
  is_ready: The peer's reply is usable.
effects:
  init: Set the context up.
  record: Remember the reply.
timers:
  wait:
    states: [waiting]
    duration: wait_s
    event: timeout
transitions:
  - {event: create, source: idle, internal: true, effects: [init]}
  - {event: go, source: idle, dest: waiting}
  - {event: reply, source: waiting, dest: done, guard: is_ready, effects: [record]}
  - {event: reply, source: waiting, internal: true, outcome: ignored}
  - {event: timeout, source: waiting, dest: failed}
invariants:
  count_matches: "count == popcount(bits)"
"""

# Transition rows of VALID, by index, for edits that replace or follow one of them.
T0 = "  - {event: create, source: idle, internal: true, effects: [init]}\n"
T1 = "  - {event: go, source: idle, dest: waiting}\n"
T2 = "  - {event: reply, source: waiting, dest: done, guard: is_ready, effects: [record]}\n"
T3 = "  - {event: reply, source: waiting, internal: true, outcome: ignored}\n"
T4 = "  - {event: timeout, source: waiting, dest: failed}\n"


# -- helpers --------------------------------------------------------------------------------

def edit(old: str, new: str, text: str = VALID) -> str:
    """Replace the one occurrence of ``old`` in ``text``."""
    assert text.count(old) == 1, f"{old!r} occurs {text.count(old)} times"
    return text.replace(old, new)


def add_transitions(*rows: str, text: str = VALID) -> str:
    """Append transition rows (flow mappings) after the last one of VALID."""
    return edit(T4, T4 + "".join(f"  - {row}\n" for row in rows), text)


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
    err = SpecError([Problem("specs/a.yaml", 12, "unknown state 'x'"),
                     Problem("specs/a.yaml", 30, "guard 'g' is declared but no transition uses it")])
    assert str(err) == ("specs/a.yaml:12: unknown state 'x'\n"
                        "specs/a.yaml:30: guard 'g' is declared but no transition uses it")
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
    text = edit(T1, "  - {event: go, source: idle, dest: waiting\n")
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
    only(problems(tmp_path, text), line_of(text, "transition: []"),
         "unknown top-level key 'transition'", "transitions")


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
    text = VALID[:VALID.index("transitions:\n")] + VALID[VALID.index("invariants:\n"):]
    found = problems(tmp_path, text)
    find(found, 1, "missing 'transitions'", "list")


def test_states_given_as_a_list(tmp_path):
    text = edit("  idle: {doc: Created.}\n  waiting: {doc: Waiting for the peer.}\n"
                "  done: {final: true}\n  failed: {final: true}\n",
                "  - idle\n  - waiting\n  - done\n  - failed\n")
    found = problems(tmp_path, text)
    p = find(found, text.splitlines().index("states:") + 1, "'states' must be a mapping, got list")
    assert "_Line" not in p.message


def test_transitions_given_as_a_mapping(tmp_path):
    text = VALID[:VALID.index("transitions:\n")] + "transitions:\n  create: idle\n" \
        + VALID[VALID.index("invariants:\n"):]
    found = problems(tmp_path, text)
    find(found, line_of(text, "transitions:"), "'transitions' must be a list, got mapping")


def test_transitions_list_of_scalars(tmp_path):
    text = VALID[:VALID.index(T0)] + "  - create\n  - go\n" + VALID[VALID.index("invariants:\n"):]
    found = problems(tmp_path, text)
    find(found, line_of(text, "- create"), "transition #0 must be a mapping")
    find(found, line_of(text, "- go"), "transition #1 must be a mapping")


def test_guard_doc_must_be_text(tmp_path):
    text = edit("  is_ready: The peer's reply is usable.", "  is_ready: {doc: x}")
    only(problems(tmp_path, text), line_of(text, "is_ready: {doc"),
         "guard 'is_ready' doc must be text, got mapping")


# -- config and context ---------------------------------------------------------------------

def test_config_key_without_default(tmp_path):
    text = edit("{default: 5.0, doc: How long to wait for the peer.}", "{doc: no default}")
    found = problems(tmp_path, text)
    find(found, line_of(text, "wait_s: {doc"), "config key 'wait_s'", "'default'")


def test_context_field_with_unknown_type(tmp_path):
    text = edit("count: {type: int,", "count: {type: integer,")
    only(problems(tmp_path, text), line_of(text, "count: {type"),
         "context field 'count' needs a type", "int, bool, float, str, bitmap, object", "'integer'")


def test_context_field_type_that_is_a_list(tmp_path):
    text = edit("count: {type: int,", "count: {type: [int],")
    only(problems(tmp_path, text), line_of(text, "count: {type"),
         "context field 'count' needs a type")


@pytest.mark.parametrize("field, old, new, value, ftype", [
    ("count", "count: {type: int, initial: 0}", "count: {type: int, initial: zero}", "'zero'", "int"),
    ("count", "count: {type: int, initial: 0}", "count: {type: int, initial: true}", "True", "int"),
    ("bits", "bits: {type: bitmap, initial: 0}", "bits: {type: bitmap, initial: 1.5}", "1.5", "bitmap"),
    ("ready", "ready: {type: bool, initial: false}", "ready: {type: bool, initial: 0}", "0", "bool"),
])
def test_context_initial_value_of_the_wrong_type(tmp_path, field, old, new, value, ftype):
    text = edit(old, new)
    only(problems(tmp_path, text), line_of(text, f"{field}: {{type"),
         f"context field {field!r}", f"initial value {value}", f"not of type {ftype}")


# -- states and events ----------------------------------------------------------------------

def test_final_flag_must_be_a_boolean(tmp_path):
    text = edit("  done: {final: true}", "  done: {final: 'yes'}")
    only(problems(tmp_path, text), line_of(text, "done: {final"),
         "state 'done'", "'final' must be true or false", "'yes'")


def test_event_with_unknown_origin(tmp_path):
    text = edit("go: {origin: local}", "go: {origin: locale}")
    only(problems(tmp_path, text), line_of(text, "go: {origin"),
         "event 'go'", "origin must be one of local, remote, timer", "'locale'")


def test_event_payload_must_map_names_to_types(tmp_path):
    text = edit("payload: {value: int}", "payload: [value]")
    only(problems(tmp_path, text), line_of(text, "reply: {origin"),
         "event 'reply'", "payload must map field names to type names")


def test_creating_event_with_remote_origin(tmp_path):
    text = edit("reply: {origin: remote,", "reply: {origin: remote, creates: true,")
    found = problems(tmp_path, text)
    find(found, line_of(text, "reply: {origin"), "event 'reply' creates transfers",
         "origin is 'remote'", "only local events may create")


def test_creates_must_be_a_boolean(tmp_path):
    text = edit("create: {origin: local, creates: true}", "create: {origin: local, creates: 'false'}")
    only(problems(tmp_path, text), line_of(text, "create: {origin"),
         "event 'create'", "'creates' must be true or false", "'false'")


def test_no_creating_event(tmp_path):
    text = edit("create: {origin: local, creates: true}", "create: {origin: local}")
    only(problems(tmp_path, text), 1, "no event is marked 'creates: true'")


def test_creating_event_not_handled_in_the_initial_state(tmp_path):
    text = edit("  go: {origin: local}\n", "  go: {origin: local}\n  spawn: {origin: local, creates: true}\n")
    text = add_transitions("{event: spawn, source: waiting, internal: true}", text=text)
    only(problems(tmp_path, text), line_of(text, "spawn: {origin"),
         "creating event 'spawn'", "no transition from initial state 'idle'")


# -- unknown names --------------------------------------------------------------------------

def test_unknown_initial_state(tmp_path):
    text = edit("initial: idle", "initial: idel")
    only(problems(tmp_path, text), 2, "unknown state 'idel' given as initial",
         "known states: idle, waiting, done, failed")


def test_missing_initial_state(tmp_path):
    text = edit("initial: idle\n", "")
    only(problems(tmp_path, text), 1, "missing 'initial'", "name of the initial state")


def test_unknown_source_state(tmp_path):
    text = edit(T1, "  - {event: go, source: idel, dest: waiting}\n")
    only(problems(tmp_path, text), line_of(text, "source: idel"),
         "unknown state 'idel' in transition #1 source", "known states: idle, waiting, done, failed")


def test_unknown_source_state_in_a_multi_line_list_points_at_its_item(tmp_path):
    text = edit(T1, "  - event: go\n    source:\n      - idle\n      - idel\n    dest: waiting\n")
    only(problems(tmp_path, text), line_of(text, "- idel"), "unknown state 'idel' in transition #1 source")


def test_unknown_dest_state(tmp_path):
    text = edit(T4, "  - {event: timeout, source: waiting, dest: fialed}\n")
    only(problems(tmp_path, text), line_of(text, "dest: fialed"),
         "unknown state 'fialed' in transition #4 dest", "known states:")


def test_unknown_timer_state(tmp_path):
    text = edit("states: [waiting]", "states: [waiting, wating]")
    only(problems(tmp_path, text), line_of(text, "states: [waiting, wating]"),
         "unknown state 'wating' in timer 'wait'", "known states:")


def test_unknown_event_in_transition(tmp_path):
    text = edit(T1, "  - {event: og, source: idle, dest: waiting}\n")
    found = problems(tmp_path, text)
    find(found, line_of(text, "event: og"), "unknown event 'og' in transition #1",
         "known events: create, reply, go, timeout")


def test_unknown_event_in_timer(tmp_path):
    text = edit("event: timeout\n", "event: timout\n")
    only(problems(tmp_path, text), line_of(text, "event: timout"),
         "unknown event 'timout' in timer 'wait'", "known events:")


def test_unknown_event_in_timer_restart_on(tmp_path):
    text = edit("event: timeout\n", "event: timeout\n    restart_on: [rpely]\n")
    only(problems(tmp_path, text), line_of(text, "restart_on"),
         "unknown event 'rpely' in timer 'wait' restart_on")


def test_unknown_guard(tmp_path):
    text = edit("guard: is_ready", "guard: is_redy")
    found = problems(tmp_path, text)
    find(found, line_of(text, "guard: is_redy"), "unknown guard 'is_redy' in transition #2",
         "declare it under 'guards'")


def test_unknown_effect(tmp_path):
    text = edit("effects: [record]", "effects: [recrod]")
    found = problems(tmp_path, text)
    find(found, line_of(text, "recrod"), "unknown effect 'recrod' in transition #2",
         "declare it under 'effects'")


# -- malformed transitions ------------------------------------------------------------------

def test_unknown_transition_key(tmp_path):
    text = edit(T1, "  - {event: go, source: idle, dest: waiting, gaurd: is_ready}\n")
    only(problems(tmp_path, text), line_of(text, "gaurd"), "transition #1: unknown key 'gaurd'",
         "dest, effects, event, guard, internal, outcome, source")


@pytest.mark.parametrize("key, value", [("event", "[go]"), ("dest", "[waiting]"), ("guard", "[is_ready]")])
def test_transition_name_given_as_a_list(tmp_path, key, value):
    row = {"event": "go", "source": "idle", "dest": "waiting"}
    row[key] = value
    text = edit(T1, "  - {" + ", ".join(f"{k}: {v}" for k, v in row.items()) + "}\n")
    found = problems(tmp_path, text)
    find(found, line_of(text, "event: " + row["event"]), f"transition #1 {key} must be a name")


def test_effects_that_are_not_names(tmp_path):
    text = edit("effects: [record]", "effects: 5")
    found = problems(tmp_path, text)
    find(found, line_of(text, "effects: 5"), "transition #2 effects must be a name or a non-empty list")


def test_source_must_not_be_empty(tmp_path):
    text = edit(T1, "  - {event: go, source: [], dest: waiting}\n")
    only(problems(tmp_path, text), line_of(text, "source: []"),
         "transition #1 source must be a name or a non-empty list of names")


def test_internal_transition_that_also_names_a_dest(tmp_path):
    text = edit(T0, "  - {event: create, source: idle, internal: true, dest: idle, effects: [init]}\n")
    only(problems(tmp_path, text), line_of(text, "event: create"),
         "transition #0 is internal and also names dest 'idle'")


def test_transition_without_dest_or_internal(tmp_path):
    text = edit(T0, "  - {event: create, source: idle, effects: [init]}\n")
    only(problems(tmp_path, text), line_of(text, "event: create"),
         "transition #0 needs a 'dest' state or 'internal: true'")


def test_internal_must_be_a_boolean(tmp_path):
    text = edit(T3, "  - {event: reply, source: waiting, internal: 'no', outcome: ignored}\n")
    found = problems(tmp_path, text)
    find(found, line_of(text, "internal: 'no'"), "transition #3", "'internal' must be true or false")


def test_eventless_internal_transition(tmp_path):
    text = add_transitions("{source: waiting, internal: true, guard: is_ready}")
    only(problems(tmp_path, text), line_of(text, "{source: waiting, internal: true"),
         "transition #5 is eventless and internal", "must change state")


def test_unknown_outcome(tmp_path):
    text = edit("outcome: ignored", "outcome: dropped")
    only(problems(tmp_path, text), line_of(text, "outcome: dropped"),
         "transition #3: outcome must be one of applied, duplicate, ignored", "'dropped'")


def test_outcome_on_a_transition_with_effects(tmp_path):
    text = edit(T0, "  - {event: create, source: idle, internal: true, effects: [init], outcome: duplicate}\n")
    only(problems(tmp_path, text), line_of(text, "event: create"),
         "transition #0 declares outcome 'duplicate'", "only for internal transitions without effects")


def test_outcome_on_a_state_changing_transition(tmp_path):
    text = edit(T1, "  - {event: go, source: idle, dest: waiting, outcome: ignored}\n")
    only(problems(tmp_path, text), line_of(text, "event: go"),
         "transition #1 declares outcome 'ignored'", "only for internal transitions")


# -- timers ---------------------------------------------------------------------------------

def test_timer_duration_not_a_config_key(tmp_path):
    text = edit("duration: wait_s", "duration: 5.0")
    only(problems(tmp_path, text), line_of(text, "duration:"),
         "timer 'wait': duration must name a config key", "got 5.0", "known: wait_s")


def test_timer_duration_given_as_a_list(tmp_path):
    text = edit("duration: wait_s", "duration: [wait_s]")
    only(problems(tmp_path, text), line_of(text, "duration:"), "timer 'wait': duration must name a config key")


def test_timer_event_whose_origin_is_not_timer(tmp_path):
    text = edit("event: timeout\n", "event: go\n")
    found = problems(tmp_path, text)
    find(found, line_of(text, "    event: go"), "timer 'wait' fires event 'go'",
         "origin must be 'timer'")


def test_timer_without_event(tmp_path):
    text = edit("    event: timeout\n", "")
    found = problems(tmp_path, text)
    find(found, line_of(text, "  wait:"), "timer 'wait' needs the 'event' it fires")


def test_timer_that_is_not_a_mapping(tmp_path):
    text = edit("    event: timeout\n", "    event: timeout\n  other: 5\n")
    only(problems(tmp_path, text), line_of(text, "other: 5"), "timer 'other' must be a mapping",
         "states, duration and event")


def test_timer_on_a_final_state(tmp_path):
    text = edit("states: [waiting]", "states: [waiting, done]")
    only(problems(tmp_path, text), line_of(text, "  wait:"),
         "timer 'wait' is armed in final state 'done'")


# -- structure: reachability, ways out, finals ----------------------------------------------

def test_unreachable_state(tmp_path):
    text = edit("  done: {final: true}\n", "  limbo: {}\n  done: {final: true}\n")
    text = add_transitions("{event: go, source: limbo, dest: done}", text=text)
    only(problems(tmp_path, text), line_of(text, "limbo: {}"),
         "unreachable state 'limbo'", "from initial state 'idle'")


def test_non_final_state_with_no_way_out(tmp_path):
    text = edit("  done: {final: true}\n", "  stuck: {}\n  done: {final: true}\n")
    text = add_transitions("{event: go, source: waiting, dest: stuck}", text=text)
    only(problems(tmp_path, text), line_of(text, "stuck: {}"),
         "non-final state 'stuck' has no way out", "no transition leaves it")


def test_non_final_states_that_cannot_reach_a_final_state(tmp_path):
    text = edit("  done: {final: true}\n", "  ping: {}\n  pong: {}\n  done: {final: true}\n")
    text = add_transitions("{event: go, source: waiting, dest: ping}",
                           "{event: go, source: ping, dest: pong}",
                           "{event: go, source: pong, dest: ping}", text=text)
    found = problems(tmp_path, text)
    find(found, line_of(text, "ping: {}"), "non-final state 'ping' can never reach a final state")
    find(found, line_of(text, "pong: {}"), "non-final state 'pong' can never reach a final state")
    assert len(found) == 2


def test_state_only_peer_messages_can_leave(tmp_path):
    text = edit("  done: {final: true}\n", "  asking: {}\n  done: {final: true}\n")
    text = add_transitions("{event: go, source: waiting, dest: asking}",
                           "{event: reply, source: asking, dest: done}", text=text)
    only(problems(tmp_path, text), line_of(text, "asking: {}"),
         "state 'asking' can only be left by peer messages", "timer")


def test_state_only_peer_messages_can_leave_despite_a_local_internal_transition(tmp_path):
    # A local event that keeps the state is no way out: the transfer still hangs if
    # the peer never answers.
    text = edit("  done: {final: true}\n", "  asking: {}\n  done: {final: true}\n")
    text = add_transitions("{event: go, source: waiting, dest: asking}",
                           "{event: reply, source: asking, dest: done}",
                           "{event: go, source: asking, internal: true, outcome: ignored}", text=text)
    only(problems(tmp_path, text), line_of(text, "asking: {}"),
         "state 'asking' can only be left by peer messages")


def test_final_state_with_an_outgoing_transition(tmp_path):
    text = add_transitions("{event: go, source: done, dest: failed}")
    only(problems(tmp_path, text), line_of(text, "source: done, dest: failed"),
         "final state 'done' has an outgoing transition #5 (go from done)", "absorbing")


def test_spec_without_a_final_state(tmp_path):
    text = edit("  done: {final: true}\n  failed: {final: true}\n", "  done: {}\n  failed: {}\n")
    found = problems(tmp_path, text)
    find(found, 1, "the spec has no final state")


# -- transitions that no guard separates ----------------------------------------------------

def test_second_transition_after_an_unguarded_one_can_never_fire(tmp_path):
    text = add_transitions("{event: timeout, source: waiting, dest: done}")
    only(problems(tmp_path, text), line_of(text, "event: timeout, source: waiting, dest: done"),
         "transitions #4 and #5 both handle event 'timeout' in state 'waiting'",
         "the first has no guard", "#5 can never fire")


def test_two_transitions_with_the_same_guard(tmp_path):
    text = edit(T2, T2 + "  - {event: reply, source: waiting, dest: failed, guard: is_ready}\n")
    found = problems(tmp_path, text)
    line = line_of(text, "dest: failed, guard: is_ready")
    find(found, line, "transitions #2 and #3 both handle event 'reply' in state 'waiting'",
         "both use guard 'is_ready'", "#3 can never fire")
    assert len(found) == 1


def test_two_unguarded_eventless_transitions_from_one_state(tmp_path):
    text = add_transitions("{source: waiting, dest: done}", "{source: waiting, dest: failed}")
    found = problems(tmp_path, text)
    find(found, line_of(text, "{source: waiting, dest: failed}"),
         "transitions #5 and #6 both handle eventless step in state 'waiting'", "the first has no guard")


def test_eventless_cycle(tmp_path):
    text = add_transitions("{source: waiting, dest: idle, guard: is_ready}",
                           "{source: idle, dest: waiting, guard: is_ready}")
    only(problems(tmp_path, text), line_of(text, "idle: {doc"),
         "eventless transitions form a cycle: idle -> waiting -> idle")


def test_eventless_self_loop(tmp_path):
    text = add_transitions("{source: waiting, dest: waiting, guard: is_ready}")
    only(problems(tmp_path, text), line_of(text, "waiting: {doc"),
         "eventless transitions form a cycle: waiting -> waiting")


# -- names declared and never used ----------------------------------------------------------

def test_unused_guard(tmp_path):
    text = edit("guards:\n", "guards:\n  spare: Never used.\n")
    only(problems(tmp_path, text), line_of(text, "spare:"), "guard 'spare' is declared but no transition uses it")


def test_unused_effect(tmp_path):
    text = edit("effects:\n", "effects:\n  spare: Never used.\n")
    only(problems(tmp_path, text), line_of(text, "spare:"), "effect 'spare' is declared but no transition uses it")


def test_unused_event(tmp_path):
    text = edit("  go: {origin: local}\n", "  go: {origin: local}\n  spare: {origin: local}\n")
    only(problems(tmp_path, text), line_of(text, "spare:"), "event 'spare' is declared but no transition handles it")


def test_event_used_only_by_a_timer_counts_as_used(tmp_path):
    text = edit(T4, "")
    text = edit("  failed: {final: true}\n", "", text)
    found = problems(tmp_path, text)
    assert not any("'timeout' is declared" in p.message for p in found)


# -- invariants -----------------------------------------------------------------------------

def test_invariant_naming_an_unknown_field(tmp_path):
    text = edit('"count == popcount(bits)"', '"count == popcount(bitz)"')
    only(problems(tmp_path, text), line_of(text, "count_matches"),
         "invariant 'count_matches'", "names 'bitz', which is not a context field",
         "known fields: bits, count, ready")


def test_invariant_with_attribute_access(tmp_path):
    text = edit('"count == popcount(bits)"', '"count.__class__ == 0"')
    only(problems(tmp_path, text), line_of(text, "count_matches"),
         "invariant 'count_matches'", "uses Attribute, which is not allowed")


def test_invariant_calling_import(tmp_path):
    text = edit('"count == popcount(bits)"', "\"__import__('os') == 0\"")
    only(problems(tmp_path, text), line_of(text, "count_matches"),
         "invariant 'count_matches'", "calls something other than abs, len, popcount")


def test_invariant_with_a_syntax_error(tmp_path):
    text = edit('"count == popcount(bits)"', '"count =="')
    only(problems(tmp_path, text), line_of(text, "count_matches"),
         "invariant 'count_matches'", "invalid expression 'count =='")


def test_invariant_that_is_not_a_string(tmp_path):
    text = edit('"count == popcount(bits)"', "[count]")
    only(problems(tmp_path, text), line_of(text, "count_matches"),
         "invariant 'count_matches' must be an expression string")


# -- several problems at once ---------------------------------------------------------------

def test_all_problems_of_a_file_are_reported_together(tmp_path):
    text = edit("initial: idle", "initial: idel")
    text = edit("guard: is_ready", "guard: is_redy", text)
    found = problems(tmp_path, text)
    find(found, 2, "unknown state 'idel'")
    find(found, line_of(text, "is_redy"), "unknown guard 'is_redy'")


# -- bindings -------------------------------------------------------------------------------

def _named(fn, name: str):
    fn.__name__ = name
    return fn


def _bindings(name: str, guards: list[str], effects: list[str]) -> Bindings:
    """Bindings with a trivial function under each given name."""
    b = Bindings(name)
    for g in guards:
        b.guard(_named(lambda transfer, event: True, g))
    for e in effects:
        b.effect(_named(lambda transfer, event, out: None, e))
    return b


def _spec():
    return parse_spec(VALID, "mini.yaml")


def test_complete_bindings_pass():
    _bindings("mini", ["is_ready"], ["init", "record"]).check(_spec())


def test_bindings_missing_a_declared_guard():
    with pytest.raises(SpecError) as info:
        _bindings("mini", [], ["init", "record"]).check(_spec())
    (p,) = info.value.problems
    assert (p.path, p.line) == ("mini.yaml", line_of(VALID, "is_ready: The peer"))
    assert "guard 'is_ready' is declared in the spec but has no Python binding" in p.message
    assert "'mini' machine module" in p.message


def test_bindings_with_an_undeclared_effect():
    with pytest.raises(SpecError) as info:
        _bindings("mini", ["is_ready"], ["init", "record", "launch"]).check(_spec())
    (p,) = info.value.problems
    assert (p.path, p.line) == ("mini.yaml", 1)
    assert "effect 'launch' is bound in Python but not declared under 'effects'" in p.message


def test_bindings_for_another_spec():
    with pytest.raises(SpecError) as info:
        _bindings("other", ["is_ready"], ["init", "record"]).check(_spec())
    (p,) = info.value.problems
    assert "spec is named 'mini' but the bindings are for 'other'" in p.message


def test_binding_a_name_twice_is_refused():
    b = Bindings("mini")

    def is_ready(t, e):
        return True

    b.guard(is_ready)
    with pytest.raises(ValueError, match="guard 'is_ready' is bound twice for spec 'mini'"):
        b.guard(is_ready)


# -- names, config values, payload types and timer coverage ------------------------------------

@pytest.mark.parametrize("name", ["state", "transfer_id", "deadlines", "config", "popcount", "_x"])
def test_context_fields_may_not_shadow_record_attributes(tmp_path, name):
    text = edit("  count: {type: int, initial: 0}\n",
                f"  count: {{type: int, initial: 0}}\n  {name}: {{type: int, initial: 0}}\n")
    find(problems(tmp_path, text), line_of(text, f"  {name}: {{type"), repr(name), "reserved")


def test_names_must_be_identifiers(tmp_path):
    text = edit("  waiting: {doc: Waiting for the peer.}\n",
                "  waiting: {doc: Waiting for the peer.}\n  not-a-name: {doc: Bad.}\n")
    find(problems(tmp_path, text), line_of(text, "not-a-name"), "'not-a-name'", "identifier")


def test_integer_state_names_are_a_problem_not_a_crash(tmp_path):
    text = edit("  waiting: {doc: Waiting for the peer.}\n",
                "  waiting: {doc: Waiting for the peer.}\n  7: {doc: Bad.}\n") + "  wrong: 1\n"
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
    text = edit("  count: {type: int, initial: 0}\n",
                "  count: {type: int, initial: 0}\n  wait_s: {type: float, initial: 1.0}\n")
    find(problems(tmp_path, text), line_of(text, "  wait_s: {type"), "'wait_s'", "config key")


def test_payload_types_must_be_known(tmp_path):
    text = edit("payload: {value: int}", "payload: {value: integr}")
    find(problems(tmp_path, text), line_of(text, "integr"), "'value'", "'integr'", "list")


def test_a_timer_needs_a_row_for_its_event_in_every_armed_state(tmp_path):
    text = edit("    states: [waiting]\n", "    states: [idle, waiting]\n")
    find(problems(tmp_path, text), line_of(text, "  wait:"), "'wait'", "'idle'", "'timeout'")

"""Hostile and oversized specs: every one ends in ``SpecError`` with ``file:line``, in
bounded time and memory, never in another exception, a hang or a blown stack.

Rules of this file: each test feeds one kind of abuse (bytes that are not UTF-8, YAML
alias bombs, deep nesting, huge numbers, huge invariants, reserved names, thousands of
states or rows) and checks where the problem is reported and that the message says what
is allowed. Work is bounded by counting it, never by reading a clock: the big-table tests
count the validator's reads of transition rows and fail as soon as they exceed a budget
linear in the number of rows.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
from pathlib import Path

import pytest

from moriio_fsm.lang.errors import Problem, SpecError
from moriio_fsm.lang.loader import load_spec, parse_spec
from moriio_fsm.lang.model import GuardSpec, TransitionSpec
from moriio_fsm.lang.validate import validate_spec


def _sibling(name: str):
    """Import a test module of this folder by path (tests/ is not a package)."""
    spec = importlib.util.spec_from_file_location(
        f"tests_lang_{name}", Path(__file__).with_name(f"{name}.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# VALID, the small sound spec, and the helpers that break it and find the problem.
_errors = _sibling("test_loader_errors")
VALID, edit, find, line_of, only, problems = (
    _errors.VALID,
    _errors.edit,
    _errors.find,
    _errors.line_of,
    _errors.only,
    _errors.problems,
)


def spec_file(tmp_path: Path, data: bytes) -> Path:
    path = tmp_path / "mini.yaml"
    path.write_bytes(data)
    return path


def load_problems(path: Path) -> list[Problem]:
    with pytest.raises(SpecError) as info:
        load_spec(path)
    for p in info.value.problems:
        assert p.path == str(path)
    return info.value.problems


# -- the file itself ------------------------------------------------------------------------


def test_a_file_that_is_not_utf8_is_a_spec_error_at_the_bad_byte(tmp_path):
    text = edit(
        "  waiting: {doc: Waiting for the peer.}", "  waiting: {doc: Waiting for the p\xe9er.}"
    )
    path = spec_file(tmp_path, text.encode("latin-1"))
    (p,) = load_problems(path)
    assert p.line == line_of(text, "waiting: {doc")
    assert (
        "not UTF-8" in p.message and "0xe9" in p.message and "save the spec as UTF-8" in p.message
    )


def test_a_file_over_the_size_limit_is_refused_before_parsing(tmp_path):
    # Valid YAML padded with a comment: only its size is wrong.
    path = spec_file(tmp_path, (VALID + "#" + "x" * (1 << 20) + "\n").encode())
    (p,) = load_problems(path)
    assert p.line == 0
    assert "is 1.0 MiB" in p.message and "at most 1 MiB" in p.message


def test_parse_spec_refuses_oversized_text_too():
    with pytest.raises(SpecError) as info:
        parse_spec(VALID + "#" + "x" * (1 << 20) + "\n", "big.yaml")
    (p,) = info.value.problems
    assert p.path == "big.yaml" and "at most 1 MiB" in p.message


# -- YAML features a spec does not need -----------------------------------------------------


def billion_laughs() -> str:
    """~1.5 KB of YAML whose aliases expand to 9**9 strings."""
    lines = ['bomb0: &a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    for level in range(1, 9):
        ref = f"*a{level - 1}"
        lines.append(f"bomb{level}: &a{level} [" + ", ".join([ref] * 9) + "]")
    return "\n".join(lines) + "\n"


@pytest.mark.timeout(30)
def test_an_alias_bomb_is_refused_at_its_first_anchor(tmp_path):
    bomb = billion_laughs()
    assert len(bomb) < 1600
    # The bomb sits where the loader would quote the value back in a message.
    text = edit(
        T1_SOURCE,
        "source: *a8, dest: waiting",
        edit(
            "transitions:\n",
            "laughs:\n"
            + "".join("  " + line + "\n" for line in bomb.splitlines())
            + "transitions:\n",
        ),
    )
    found = problems(tmp_path, text)
    only(
        found,
        line_of(text, "bomb0:"),
        "anchors (&name) and aliases (*name) are not allowed",
        "write the value out",
    )


T1_SOURCE = "source: idle, dest: waiting"


def test_a_single_alias_is_refused_too(tmp_path):
    text = edit("  waiting: {doc: Waiting for the peer.}", "  waiting: {doc: &d Waiting.}")
    text = edit("  done: {final: true}", "  done: {final: true, doc: *d}", text)
    only(problems(tmp_path, text), line_of(text, "&d"), "anchors (&name) and aliases (*name)")


@pytest.mark.parametrize("opening, closing", [("[", "]"), ("{a: ", "}")], ids=["lists", "mappings"])
def test_nesting_20000_levels_deep_is_refused(tmp_path, opening, closing):
    depth = 20_000
    text = VALID + "summary: " + opening * depth + "1" + closing * depth + "\n"
    only(problems(tmp_path, text), line_of(text, "summary:"), "nested deeper than 32 levels")


def test_nesting_within_the_limit_is_an_ordinary_type_problem(tmp_path):
    text = VALID + "summary: " + "[" * 20 + "1" + "]" * 20 + "\n"
    only(problems(tmp_path, text), line_of(text, "summary:"), "summary must be text, got list")


# -- numbers --------------------------------------------------------------------------------

BIG = "9" * 400


@pytest.mark.parametrize(
    "old, new, marker, words",
    [
        (
            "wait_s: {default: 5.0,",
            f"wait_s: {{default: {BIG},",
            "wait_s:",
            ("config key 'wait_s'", "below 2**63"),
        ),
        (
            "count: {type: int, initial: 0}",
            f"count: {{type: int, initial: {BIG}}}",
            "count: {type",
            ("context field 'count'", "below 2**63"),
        ),
        (
            "bits: {type: bitmap, initial: 0}",
            f"bits: {{type: bitmap, initial: -{BIG}}}",
            "bits: {type",
            ("context field 'bits'", "below 2**63"),
        ),
        (
            "payload: {value: int}",
            f"payload: {{value: {{type: int, default: {BIG}}}}}",
            "reply: {origin",
            ("payload field 'value'", "below 2**63"),
        ),
        (
            '"count == popcount(bits)"',
            f'"count == {BIG}"',
            "count_matches",
            ("invariant 'count_matches'", "below 2**63"),
        ),
    ],
    ids=["config", "context", "bitmap", "payload", "invariant"],
)
def test_a_400_digit_integer_is_refused(tmp_path, old, new, marker, words):
    text = edit(old, new)
    only(problems(tmp_path, text), line_of(text, marker), BIG[:20], *words)


def test_an_integer_longer_than_python_converts_is_a_spec_error(tmp_path):
    # Python refuses to convert more than 4300 digits with a ValueError of its own.
    text = edit("count: {type: int, initial: 0}", f"count: {{type: int, initial: {'7' * 5000}}}")
    only(problems(tmp_path, text), line_of(text, "count: {type"), "integer", "digits")


@pytest.mark.parametrize("value", [".inf", "-.inf", ".nan", "1.0e+400"])
def test_context_float_initial_must_be_finite(tmp_path, value):
    text = edit(
        "  count: {type: int, initial: 0}\n",
        f"  count: {{type: int, initial: 0}}\n  ratio: {{type: float, initial: {value}}}\n",
    )
    only(problems(tmp_path, text), line_of(text, "ratio:"), "context field 'ratio'", "finite")


def test_config_default_just_below_the_bound_is_accepted(tmp_path):
    text = edit("wait_s: {default: 5.0,", f"wait_s: {{default: {2**63 - 1},")
    assert problems(tmp_path, text) == []


# -- invariants: size, depth and types --------------------------------------------------------


@pytest.mark.timeout(60)
def test_an_invariant_of_100000_terms_is_refused(tmp_path):
    expr = " + ".join(["count"] * 100_000) + " >= 0"
    text = edit('"count == popcount(bits)"', f'"{expr}"')
    only(
        problems(tmp_path, text),
        line_of(text, "count_matches"),
        "invariant 'count_matches'",
        "characters long",
        "at most 1000",
    )


def test_an_invariant_nested_too_deeply_is_refused(tmp_path):
    expr = "~" * 400 + "count == 0"
    text = edit('"count == popcount(bits)"', f'"{expr}"')
    only(
        problems(tmp_path, text),
        line_of(text, "count_matches"),
        "invariant 'count_matches'",
        "nested deeper than 32",
    )


def test_an_invariant_with_too_many_terms_is_refused(tmp_path):
    # A comparison chain is flat (depth 2), so only its node count is over a bound.
    expr = "count" + " <count" * 140
    assert len(expr) < 1000
    text = edit('"count == popcount(bits)"', f'"{expr}"')
    only(
        problems(tmp_path, text),
        line_of(text, "count_matches"),
        "invariant 'count_matches'",
        "more than 256 parts",
    )


def with_name_field(expr: str) -> str:
    text = edit(
        "  count: {type: int, initial: 0}\n",
        '  count: {type: int, initial: 0}\n  end_reason: {type: str, initial: ""}\n'
        "  ids: {type: object, initial: null}\n",
    )
    return edit('"count == popcount(bits)"', f'"{expr}"', text)


@pytest.mark.parametrize(
    "expr, words",
    [
        (
            "popcount(end_reason) == 0",
            ("popcount(end_reason)", "int, bitmap or bool", "end_reason is a str"),
        ),
        ("len(count) == 0", ("len(count)", "str or object", "count is an int")),
        ("abs(end_reason) < 1", ("abs(end_reason)", "int or float", "a str")),
        ("popcount(ids) == 0", ("popcount(ids)", "ids is an object")),
        ("count + end_reason == 0", ("count + end_reason", "int and str")),
        ("bits & 1.5 == 0", ("bits & 1.5", "int, bitmap or bool", "float")),
        ("end_reason < 3", ("end_reason < 3", "str and int")),
        ("end_reason == 0", ("end_reason == 0", "str and int", "never equal")),
        ("count is 0", ("count is 0", "only with None")),
        ("ids + 1 == 0", ("ids + 1", "object")),
        ("popcount(count, bits) == 0", ("popcount", "exactly one argument")),
        ("-end_reason == 0", ("-end_reason", "a str")),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_an_invariant_calling_or_combining_the_wrong_types(tmp_path, expr, words):
    text = with_name_field(expr)
    only(
        problems(tmp_path, text),
        line_of(text, "count_matches"),
        "invariant 'count_matches'",
        *words,
    )


@pytest.mark.parametrize(
    "expr",
    [
        "popcount(bits) == count and popcount(ready) <= 1",
        "len(end_reason) == 0 or len(ids) > 0",
        "abs(count) >= 0 and ids is not None or end_reason != ''",
        "(1 if ready else 0) + count * 2 - 1 >= -1",
        "state == 'done' or state != 'failed'",
        "bits & ~bits == 0 and (bits >> 1) | (1 << 3) >= 0",
    ],
)
def test_well_typed_invariants_pass(tmp_path, expr):
    assert problems(tmp_path, with_name_field(expr)) == []


def test_a_complex_constant_is_refused(tmp_path):
    text = edit('"count == popcount(bits)"', '"count == 1j"')
    only(problems(tmp_path, text), line_of(text, "count_matches"), "constant 1j", "complex")


# -- names the runtime reserves ---------------------------------------------------------------

RESERVED = ["__eventless__", "__init__"]


@pytest.mark.parametrize("name", RESERVED)
@pytest.mark.parametrize(
    "what, old, new",
    [
        (
            "state",
            "  waiting: {doc: Waiting for the peer.}\n",
            "  waiting: {doc: Waiting for the peer.}\n  NAME: {doc: Bad.}\n",
        ),
        ("event", "  go: {origin: local}\n", "  go: {origin: local}\n  NAME: {origin: local}\n"),
        ("guard", "guards:\n", "guards:\n  NAME: Bad.\n"),
        ("action", "actions:\n", "actions:\n  NAME: Bad.\n"),
        ("emit", "emits:\n", "emits:\n  NAME: {doc: Bad.}\n"),
        (
            "timer",
            "timers:\n",
            "timers:\n  NAME: {states: [waiting], duration: wait_s, event: timeout}\n",
        ),
        ("context field", "context:\n", "context:\n  NAME: {type: int, initial: 0}\n"),
        ("config key", "config:\n", "config:\n  NAME: {default: 1}\n"),
        ("payload field", "payload: {value: int}", "payload: {value: int, NAME: int}"),
        ("emit field", "fields: {count: int}", "fields: {count: int, NAME: int}"),
    ],
)
def test_names_the_runtime_reserves_are_refused(tmp_path, name, what, old, new):
    text = edit(old, new.replace("NAME", name))
    found = problems(tmp_path, text)
    p = find(found, line_of(text, name), what, repr(name))
    assert "reserved" in p.message and "'__'" in p.message


# -- big tables: the validator's work grows linearly ------------------------------------------


class _Budget(Exception):
    pass


_work = {"reads": 0, "budget": math.inf}


class CountingRow(TransitionSpec):
    """A transition row that counts every attribute read, and stops the validator once
    the reads pass the budget (so a quadratic check fails fast instead of running long)."""

    def __getattribute__(self, name):
        _work["reads"] += 1
        if _work["reads"] > _work["budget"]:
            raise _Budget(f"validation read transition rows more than {_work['budget']} times")
        return super().__getattribute__(name)


BASE = """\
name: big
initial: s0
config:
  wait_s: {default: 5.0}
states:
  s0: {}
  done: {final: true}
events:
  create: {origin: local, creates: true}
  go: {origin: local}
  reply: {origin: remote}
transitions:
  - {event: create, source: s0, internal: true}
"""

READS_PER_ROW = 50  # a linear validator needs under 20; a quadratic one, n


def validate_counted(spec) -> list[Problem]:
    rows = tuple(
        CountingRow(**{f.name: getattr(t, f.name) for f in dataclasses.fields(t)})
        for t in spec.transitions
    )
    spec = dataclasses.replace(spec, transitions=rows)
    _work.update(reads=0, budget=READS_PER_ROW * len(rows))
    try:
        return validate_spec(spec)
    finally:
        _work.update(budget=math.inf)


def row(index, event, source, dest=None, guard=None):
    return TransitionSpec(index, event, (source,), dest, guard, (), (), "applied", index + 20)


@pytest.mark.timeout(120)
def test_20000_rows_separated_by_guards_validate_with_linear_work():
    n = 20_000
    base = parse_spec(BASE, "big.yaml")
    rows = [base.transitions[0], row(1, "go", "s0", dest="done")]
    rows += [row(2 + i, "reply", "s0", guard=f"g{i}") for i in range(n)]
    guards = {f"g{i}": GuardSpec(f"g{i}", "", (), 30) for i in range(n)}
    spec = dataclasses.replace(base, guards=guards, transitions=tuple(rows))
    assert validate_counted(spec) == []


@pytest.mark.timeout(120)
def test_20000_unguarded_rows_for_one_trigger_give_one_problem_each():
    # Every row after the first is shadowed by it; each is reported once, not once per pair.
    n = 20_000
    base = parse_spec(BASE, "big.yaml")
    rows = [base.transitions[0], row(1, "go", "s0", dest="done")]
    rows += [row(2 + i, "reply", "s0") for i in range(n)]
    found = validate_counted(dataclasses.replace(base, transitions=tuple(rows)))
    assert len(found) == n - 1
    assert all(
        "transitions #2 and #" in p.message and "the first has no guard" in p.message for p in found
    )


def chain(n: int) -> str:
    """A spec whose states s0..s{n} are joined by unguarded eventless rows."""
    states = "".join(f"  s{i}: {{}}\n" for i in range(n)) + f"  s{n}: {{final: true}}\n"
    rows = "".join(f"  - {{source: s{i}, dest: s{i + 1}}}\n" for i in range(n))
    return (
        "name: chain\ninitial: s0\nstates:\n"
        + states
        + "events:\n  create: {origin: local, creates: true}\n"
        + "transitions:\n  - {event: create, source: s0, internal: true}\n"
        + rows
    )


@pytest.mark.timeout(120)
def test_a_chain_of_5000_eventless_rows_loads(tmp_path):
    path = spec_file(tmp_path, chain(5000).encode())
    spec = load_spec(path)
    assert len(spec.states) == 5001


@pytest.mark.timeout(120)
def test_a_chain_of_5000_states_validates_with_linear_work():
    spec = parse_spec(chain(5000), "chain.yaml")
    assert validate_counted(spec) == []


@pytest.mark.timeout(120)
def test_a_long_eventless_cycle_is_reported_once():
    text = chain(3000).replace("  s3000: {final: true}\n", "  s3000: {}\n  end: {final: true}\n")
    text += "  - {source: s3000, dest: s0}\n  - {event: create, source: s3000, dest: end}\n"
    found = validate_counted(parse_spec(text, "cycle.yaml"))
    (p,) = [p for p in found if "cycle" in p.message]
    assert p.message.startswith("eventless transitions form a cycle: s0 -> s1 -> ")
    assert p.message.endswith("s2999 -> s3000 -> s0")

"""Bounds between config keys (``exceeds``): how the loader reads them, with file:line for
every bad one, and that the shipped specs state the bounds and their defaults keep them.

Each test edits the shipped write_consumer spec (whose safety_timeout_s is bound by
write_producer's drain), writes it to a file and loads it; lines are found by a marker.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from moriio_fsm.cli import main as cli
from moriio_fsm.lang.errors import Problem, SpecError
from moriio_fsm.lang.loader import load_spec, parse_spec
from moriio_fsm.lang.shipped import SHIPPED_SPECS, spec_path

BOUND = "    exceeds: [write_producer.transfer_timeout_s, write_producer.abandon_timeout_s]\n"
SHIPPED = spec_path("write_consumer").read_text(encoding="utf-8")


def with_bound(new: str, old: str = BOUND, text: str = SHIPPED) -> str:
    assert text.count(old) == 1, f"{old!r} occurs {text.count(old)} times"
    return text.replace(old, new)


def line_of(text: str, marker: str) -> int:
    hits = [n for n, line in enumerate(text.splitlines(), 1) if marker in line]
    assert len(hits) == 1, f"marker {marker!r} is on lines {hits}"
    return hits[0]


def problems(tmp_path: Path, text: str) -> list[Problem]:
    path = tmp_path / "write_consumer.yaml"
    path.write_text(text, encoding="utf-8")
    try:
        load_spec(path)
    except SpecError as exc:
        assert all(p.path == str(path) for p in exc.problems)
        return exc.problems
    return []


def only(found: list[Problem], line: int, *words: str) -> Problem:
    assert len(found) == 1, "expected one problem, got:\n" + "\n".join(map(str, found))
    (p,) = found
    assert p.line == line and all(w in p.message for w in words), str(p)
    return p


# -- the shipped specs ------------------------------------------------------------------------


def test_the_shipped_specs_state_both_bounds_between_their_machines():
    consumer = load_spec(spec_path("write_consumer"))
    producer = load_spec(spec_path("read_producer"))
    assert [str(r) for r in consumer.config["safety_timeout_s"].exceeds] == [
        "write_producer.transfer_timeout_s",
        "write_producer.abandon_timeout_s",
    ]
    assert [str(r) for r in producer.config["lease_s"].exceeds] == [
        "read_consumer.read_timeout_s",
        "read_consumer.lease_margin_s",
    ]


def test_validate_passes_every_shipped_spec_and_refuses_defaults_that_break_a_bound(
    tmp_path, capsys
):
    assert cli(["validate", *(str(spec_path(name)) for name in SHIPPED_SPECS)]) == 0
    text = with_bound(
        BOUND, text=SHIPPED.replace("    default: 60.0\n" + BOUND, "    default: 40.0\n" + BOUND)
    )
    path = tmp_path / "write_consumer.yaml"
    path.write_text(text, encoding="utf-8")
    capsys.readouterr()
    assert cli(["validate", str(path)]) == 1
    err = capsys.readouterr().err
    assert (
        f"{path}:{line_of(text, 'safety_timeout_s:')}: the defaults break a bound: "
        "write_consumer's safety_timeout_s (40.0) must exceed write_producer's "
        "transfer_timeout_s (30.0) + abandon_timeout_s (10.0) = 40.0"
    ) in err


# -- the shape of a bound ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "value, words",
    [
        (
            "write_producer.transfer_timeout_s",
            ("non-empty list of MACHINE.KEY", "got 'write_producer"),
        ),
        ("[]", ("non-empty list",)),
        ("", ("non-empty list", "got None")),
        ("{write_producer: transfer_timeout_s}", ("non-empty list", "got {")),
    ],
)
def test_a_bound_that_is_not_a_list_of_names_is_refused_at_its_line(tmp_path, value, words):
    text = with_bound(f"    exceeds: {value}\n")
    only(
        problems(tmp_path, text), line_of(text, "exceeds:"), "config key 'safety_timeout_s'", *words
    )


@pytest.mark.parametrize(
    "item",
    [
        "3",
        "transfer_timeout_s",
        "write_producer.",
        ".transfer_timeout_s",
        "write_producer.transfer.timeout",
        "write producer.x",
        "[a.b]",
    ],
)
def test_an_item_that_is_not_machine_dot_key_is_refused_at_its_line(tmp_path, item):
    text = with_bound(
        f"    exceeds:\n      - write_producer.abandon_timeout_s\n      - {item}  # bad\n"
    )
    only(problems(tmp_path, text), line_of(text, "# bad"), "exceeds:", "is not MACHINE.KEY")


def test_a_key_named_twice_is_refused(tmp_path):
    text = with_bound(
        "    exceeds:\n      - write_producer.abandon_timeout_s\n"
        "      - write_producer.abandon_timeout_s   # again\n"
    )
    only(
        problems(tmp_path, text),
        line_of(text, "# again"),
        "names 'write_producer.abandon_timeout_s' twice",
    )


def test_a_misspelt_key_of_a_config_entry_is_refused_not_ignored(tmp_path):
    # 'exceed' read as nothing would silently drop the bound.
    text = with_bound(BOUND.replace("exceeds", "exceed"))
    only(
        problems(tmp_path, text),
        line_of(text, "exceed:"),
        "unknown key 'exceed'",
        "expected default, doc, exceeds",
    )


def test_parse_spec_reads_the_shape_only_and_keeps_each_name_s_line():
    text = with_bound(
        "    exceeds:\n      - write_producer.transfer_timeout_s\n      - nowhere.at_all\n"
    )
    spec = parse_spec(text, "w.yaml")
    refs = spec.config["safety_timeout_s"].exceeds
    assert [(r.machine, r.key, r.line) for r in refs] == [
        ("write_producer", "transfer_timeout_s", line_of(text, "- write_producer")),
        ("nowhere", "at_all", line_of(text, "nowhere")),
    ]


# -- what a bound names -----------------------------------------------------------------------


def test_a_bound_naming_an_unknown_machine_is_refused_listing_the_known(tmp_path):
    text = with_bound(BOUND.replace("write_producer.abandon", "write_prducer.abandon"))
    only(
        problems(tmp_path, text),
        line_of(text, "exceeds:"),
        "unknown machine 'write_prducer'",
        "known machines: write_consumer, write_producer, read_producer, read_consumer",
    )


def test_a_bound_naming_a_key_the_machine_lacks_is_refused_listing_its_keys(tmp_path):
    text = with_bound(BOUND.replace("abandon_timeout_s", "abandon_s"))
    only(
        problems(tmp_path, text),
        line_of(text, "exceeds:"),
        "'write_producer.abandon_s'",
        "machine 'write_producer' has no config key 'abandon_s'",
        "its keys: defer_timeout_s, transfer_timeout_s, abandon_timeout_s",
    )


def test_a_key_bound_by_itself_is_refused(tmp_path):
    text = with_bound(
        BOUND.replace("write_producer.abandon_timeout_s", "write_consumer.safety_timeout_s")
    )
    only(problems(tmp_path, text), line_of(text, "exceeds:"), "names the key itself")


def test_a_bound_may_name_keys_of_its_own_machine(tmp_path):
    holds = with_bound(
        BOUND,
        text=SHIPPED.replace(
            "  write_timeout_s:\n    default: 120.0\n",
            "  write_timeout_s:\n    default: 120.0\n    exceeds: [write_consumer.safety_timeout_s]\n",
        ),
    )
    assert problems(tmp_path, holds) == []
    breaks = with_bound("    exceeds: [write_consumer.write_timeout_s]\n")
    only(
        problems(tmp_path, breaks),
        line_of(breaks, "safety_timeout_s:"),
        "the defaults break a bound: write_consumer's safety_timeout_s (60.0) must exceed "
        "write_consumer's write_timeout_s (120.0)",
    )


def test_a_value_equal_to_its_bound_breaks_it(tmp_path):
    # "exceed" is strict: P's drain must end before D gives up, not at the same moment.
    text = with_bound("    exceeds: [write_producer.defer_timeout_s]\n")  # 60.0 too
    only(
        problems(tmp_path, text),
        line_of(text, "safety_timeout_s:"),
        "write_consumer's safety_timeout_s (60.0) must exceed write_producer's "
        "defer_timeout_s (60.0)",
    )

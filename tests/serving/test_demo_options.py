"""The demo's shape options: how many P and D, and which one is killed mid-run; each wrong value
is refused naming the option and what it takes."""

from __future__ import annotations

import pytest

from moriio_fsm.serving.demo_options import FAULT_TIMEOUTS, DemoOptions, connector_faults


def test_by_default_one_p_one_d_and_nothing_killed():
    options = DemoOptions()
    assert (options.prefills, options.decodes, options.kill, options.disrupted) == (
        1,
        1,
        None,
        False,
    )


def test_faults_kill_p0_unless_told_otherwise():
    assert DemoOptions(faults=0.05).kill == "P0"
    assert DemoOptions(faults=0.05, prefills=3, kill="P2").kill == "P2"


@pytest.mark.parametrize(
    "options, named",
    [
        ({"decodes": 0}, "--decodes: expected 1 to 8"),
        ({"decodes": 9}, "--decodes: expected 1 to 8"),
        ({"decodes": True}, "--decodes"),
        ({"decodes": "2"}, "--decodes"),
        ({"kill": "D1"}, "--kill: expected an instance P0..P0 or D0..D0"),
        ({"kill": "P0"}, "--kill P0 leaves no P to serve: it needs --prefills 2"),
        ({"kill": "D0", "decodes": 1, "prefills": 2}, "leaves no D to serve: it needs --decodes 2"),
        ({"kill": "X0", "prefills": 2}, "--kill: expected an instance"),
        ({"kill": "P", "prefills": 2}, "--kill: expected an instance"),
        ({"kill": "P-1", "prefills": 2}, "--kill: expected an instance"),
        ({"kill": 0, "prefills": 2}, "--kill: expected an instance"),
    ],
)
def test_a_wrong_shape_is_refused_naming_the_option(options, named):
    with pytest.raises(ValueError, match=named):
        DemoOptions(**options)


def test_a_kill_without_faults_still_runs_with_short_timeouts_and_takes_clear_failures():
    options = DemoOptions(decodes=2, kill="D1")
    assert options.disrupted and options.faults == 0
    assert connector_faults(0.0, 0) == FAULT_TIMEOUTS  # no injection, short timeouts


def test_the_demo_command_takes_decodes_and_kill():
    from moriio_fsm.cli import build_parser

    args = build_parser().parse_args(["demo", "--decodes", "2", "--kill", "D1"])
    assert (args.decodes, args.kill) == (2, "D1")

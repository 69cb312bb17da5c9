"""CI's model-checking run: every shipped spec and both pairs, within bounds sized so that
all of it takes well under two minutes here, and every rule holds everywhere in them.

The bounds (docs/model-checking.md says what each means): one machine with two layers,
four peer or adapter events per run and two ranks on the other side (one for
write_producer, whose writer count it only passes on); a pair with one layer and one
fault, time moving from deadline to deadline.
"""

from __future__ import annotations

import pytest

from moriio_fsm.check import Bounds, check_pair, check_spec
from moriio_fsm.check.report import render_finding, summary

SINGLE = Bounds(layers=2, writers=2, peer_events=4, tick_s="off")
WRITERS = {"write_producer": 1}
PAIR = Bounds(layers=1, faults=1, tick_s="off")


def explain(result) -> str:
    return "\n".join(
        [summary(result)]
        + [line for finding in result.findings.values() for line in render_finding(finding)]
    )


@pytest.mark.parametrize(
    "name", ["write_producer", "write_consumer", "read_producer", "read_consumer"]
)
def test_every_rule_holds_for_the_spec(name):
    result = check_spec(name, SINGLE.with_(writers=WRITERS.get(name, SINGLE.writers)))
    assert result.complete and result.ok, explain(result)
    assert result.ended > 0 and result.stuck == 0


@pytest.mark.parametrize("mode", ["write", "read"])
def test_every_rule_holds_for_the_pair(mode):
    result = check_pair(mode, PAIR)
    assert result.complete and result.ok, explain(result)
    assert result.ended > 0 and result.stuck == 0

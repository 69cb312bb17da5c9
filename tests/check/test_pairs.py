"""The pair checker on the shipped machines: P and D of one mode over a channel that loses,
duplicates and delays messages, with an engine that fails and stalls.

What it must prove: no block goes back while a write or read may still land in it (or,
for P's blocks in READ mode, read from it), no operation is posted on blocks that went
back, and both sides end on their own.
"""

from __future__ import annotations

from moriio_fsm.check import Bounds, check_pair

SMALL = Bounds(layers=1, faults=0, tick_s="off")


def test_ds_blocks_never_go_back_while_ps_writes_may_land():
    """D used to give its blocks back on its safety timeout, assuming P's writes had
    stopped; a lost release and a slow forward pass on P proved it wrong (P then wrote
    into blocks vLLM had reused). D now quarantines them instead."""
    result = check_pair("write", SMALL)
    assert result.complete
    assert "freed_under_operation" not in result.findings, result.findings
    assert "operation_on_freed_blocks" not in result.findings, result.findings
    assert result.ok, list(result.findings)


def test_the_read_pair_holds_within_small_bounds():
    result = check_pair("read", SMALL)
    assert result.ok, list(result.findings)

"""The pair checker on the shipped machines: P and D of one mode over a channel that loses,
duplicates and delays messages, with an engine that fails and stalls.

What it must prove: no block goes back while a write or read may still land in it (or,
for P's blocks in READ mode, read from it), no operation is posted on blocks that went
back, and both sides end on their own.
"""

from __future__ import annotations

from moriio_fsm.check import Bounds, check_pair
from moriio_fsm.check.pair import PAIR_CONFIGS
from moriio_fsm.check.report import steps_of
from moriio_fsm.check.single import Dispatch
from moriio_fsm.lang.loader import load_spec
from moriio_fsm.machines import load_bindings, resolve_config, spec_path
from moriio_fsm.runtime.declared import emits
from moriio_fsm.runtime.machine import Machine

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


def test_the_old_safety_timeout_planted_again_is_found(tmp_path):
    """A regression guard for the fix above: the freeing safety timeout, planted in a copy
    of the spec, must be found again (both ways it goes wrong)."""
    text = spec_path("write_consumer").read_text()
    for old, new in OLD_SAFETY_TIMEOUT:
        assert old in text, old
        text = text.replace(old, new)
    path = tmp_path / "write_consumer.yaml"
    path.write_text(text)
    spec = load_spec(path)
    old_d = Machine(spec, load_bindings(spec).replaced(give_up_waiting), resolve_config(spec, None))
    result = check_pair("write", SMALL, machines={"write_consumer": old_d})
    assert {"freed_under_operation", "operation_on_freed_blocks"} <= set(result.findings)
    steps = [
        s.event.kind
        for s in steps_of(result.findings["operation_on_freed_blocks"].path)
        if isinstance(s, Dispatch)
    ]
    assert steps[-2:] == ["safety_timeout", "layer_scheduled"]  # P's first write, too late


def can_read(tx, ev) -> bool:  # planted: D reads whatever its lease says
    return tx.reads_wanted


def test_a_reader_that_ignores_its_lease_is_caught_reading_freed_blocks():
    spec = load_spec(spec_path("read_consumer"))
    config = resolve_config(spec, PAIR_CONFIGS["read"]["read_consumer"])
    reader = Machine(spec, load_bindings(spec).replaced(can_read), config)
    result = check_pair("read", SMALL, machines={"read_consumer": reader})
    assert (
        "P: free_blocks while a read from its blocks (layer(s) 0)"
        in result.findings["freed_under_operation"].message
    )
    assert (
        "P: a read of layer 0 posted after the blocks went back"
        in result.findings["operation_on_freed_blocks"].message
    )


def test_a_creating_step_that_raises_is_a_finding_and_ends_its_branch():
    """P's creating step breaking a rule ends the branch before D is created: the checker
    reports the step, with its path, instead of failing on the ended branch."""

    def valid_writer_count(tx, ev) -> bool:  # planted: P's creating step raises
        raise RuntimeError("planted")

    spec = load_spec(spec_path("write_producer"))
    config = resolve_config(spec, PAIR_CONFIGS["write"]["write_producer"])
    broken = Machine(spec, load_bindings(spec).replaced(valid_writer_count), config)
    result = check_pair("write", SMALL, machines={"write_producer": broken})
    finding = result.findings["binding_raised"]
    assert "raised RuntimeError: planted" in finding.message
    assert [s.event.kind for s in steps_of(finding.path) if isinstance(s, Dispatch)] == [
        "prefill_started"
    ]


OLD_SAFETY_TIMEOUT = [
    (
        """      Nobody confirmed the writes stopped in time: keep the blocks out of circulation for
      good, and fail the load if the request still waits.
    writes: [blocks_quarantined, reported_failure]""",
        """      Nobody confirmed the writes stopped in time; assume they did.
    writes: [blocks_freed, reported_failure]""",
    ),
    (
        """actions: [give_up_waiting],
     emits: [quarantine_blocks, report_load_failure]}""",
        """actions: [give_up_waiting],
     emits: [free_blocks, report_load_failure]}""",
    ),
    (
        """  blocks_freed_only_when_stopped: "blocks_freed == 0 or verdicts == num_writers\"""",
        """  blocks_freed_only_when_stopped: "blocks_freed == 0 or verdicts == num_writers or state == 'abandoned'\"""",
    ),
]


def give_up_waiting(tx, ev, out) -> None:  # the rule as it was
    if tx.request_finished:
        tx.blocks_freed += 1
        out.append(emits.free_blocks(tx.transfer_id, reason="safety_timeout"))
    else:
        tx.reported_failure += 1
        out.append(emits.report_load_failure(tx.transfer_id, reason="safety_timeout"))


def test_blocks_quarantined_after_the_failed_load_gave_them_back_are_caught():
    """The pair judges a quarantine by the ledger's rule too: once D reported the load
    failed, vLLM owns the blocks again, and keeping them out of circulation is too late."""

    def give_up_waiting(tx, ev, out) -> None:  # planted: fails the load, then quarantines
        if not tx.request_finished:
            tx.reported_failure += 1
            out.append(emits.report_load_failure(tx.transfer_id, reason="safety_timeout"))
        tx.blocks_quarantined += 1
        out.append(emits.quarantine_blocks(tx.transfer_id, reason="safety_timeout"))

    spec = load_spec(spec_path("write_consumer"))
    late = Machine(spec, load_bindings(spec).replaced(give_up_waiting), resolve_config(spec, None))
    result = check_pair("write", SMALL, machines={"write_consumer": late})
    assert result.findings["blocks_leave_once"].message == (
        "D: quarantine_blocks after the blocks had already left"
    )
    steps = [
        s.event.kind
        for s in steps_of(result.findings["blocks_leave_once"].path)
        if isinstance(s, Dispatch)
    ]
    assert steps[-1] == "safety_timeout"

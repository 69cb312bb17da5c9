"""A step is all or nothing, and when it fails it says where.

A guard, an action or an eventless follow-up that raises leaves the transfer exactly as
it was (context, state, timers), produces no effect and raises ``TransitionError``
naming the transfer, the event, the binding and the spec row; a recorder that raises
never costs a step. Generated steps show their source in tracebacks, and check mode
runs the very same generated code plus its proofs.
"""

from __future__ import annotations

import logging
import traceback

import pytest

from moriio_fsm.machines import build_machine, build_table, write_producer
from moriio_fsm.runtime.declared import emits, events
from moriio_fsm.runtime.errors import InvariantViolation, TimerStepsFailed, TransitionError
from moriio_fsm.runtime.events import Outcome
from moriio_fsm.runtime.machine import Machine
from moriio_fsm.runtime.table import TransferTable

BASE = build_machine("write_producer")


def machine_with(*replacements) -> Machine:
    """The write producer with some bindings replaced by same-named functions."""
    return Machine(BASE.spec, write_producer.bindings.replaced(*replacements), BASE.config)


def snapshot(table, tid):
    tx = table.get(tid)
    return tx.state, tx.context(), list(tx.deadlines)


def post_layer(tx, ev, out):  # writes posted, then fails mid-way
    tx.posted |= 1 << ev.layer
    out.append(
        emits.post_write(
            tx.transfer_id,
            layer=ev.layer,
            block_ids=tx.remote_block_ids,
            decode_rank=tx.decode_rank,
        )
    )
    raise KeyError("engine handle missing")


def tell_write_done(tx, ev, out):  # fails after counting the verdict
    tx.write_done_sent += 1
    if tx.write_done_sent > 1:
        out.append(emits.send_write_done(tx.transfer_id, num_writers=1, decode_rank=0))
    raise RuntimeError("encoder broke")


def layer_in_flight(tx, ev):
    raise ValueError("guard exploded")


@pytest.mark.parametrize("executor", ["compiled", "transitions"])
@pytest.mark.parametrize("checked", [False, True])
def test_an_action_that_raises_mid_step_leaves_the_transfer_untouched(executor, checked):
    table = TransferTable(machine_with(post_layer), executor=executor, check_invariants=checked)
    table.dispatch(events.prefill_started("tx-1", 0.0, 1))
    table.dispatch(events.remote_blocks("tx-1", 0.0, [5, 6], 0))
    before = snapshot(table, "tx-1")
    stats_before = table.stats()["outcomes"]
    with pytest.raises(TransitionError) as info:
        table.dispatch(events.layer_scheduled("tx-1", 1.0, 2))
    assert snapshot(table, "tx-1") == before  # scheduled, posted: as they were
    assert table.stats()["outcomes"] == stats_before  # the failed step is not counted
    message = str(info.value)
    assert "'tx-1'" in message and "layer_scheduled" in message and "KeyError" in message
    assert info.value.transfer_id == "tx-1" and info.value.event == "layer_scheduled"
    if executor == "compiled":
        assert info.value.binding == "post_layer"
        assert "action 'post_layer'" in message and "write_producer.yaml:" in message
    # The transfer is still fine: the next event applies normally.
    assert table.dispatch(events.request_finished("tx-1", 2.0)).outcome is Outcome.APPLIED


@pytest.mark.parametrize("executor", ["compiled", "transitions"])
def test_an_eventless_follow_up_that_raises_rolls_the_whole_step_back(executor):
    table = TransferTable(machine_with(tell_write_done), executor=executor)
    table.dispatch(events.prefill_started("tx-1", 0.0, 1))
    table.dispatch(events.remote_blocks("tx-1", 0.0, [5], 0))
    table.dispatch(events.layer_scheduled("tx-1", 0.1, 0))
    table.dispatch(events.seal("tx-1", 0.2))
    before = snapshot(table, "tx-1")
    with pytest.raises(TransitionError, match="RuntimeError: encoder broke"):
        table.dispatch(events.layer_write_completed("tx-1", 0.3, 0))  # sealed -> completed
    state, context, deadlines = snapshot(table, "tx-1")
    assert (state, context, deadlines) == before
    assert context["settled"] == 0 and context["write_done_sent"] == 0
    assert table.audit() == []


def test_a_guard_that_raises_is_named_and_changes_nothing():
    table = TransferTable(machine_with(layer_in_flight))
    table.dispatch(events.prefill_started("tx-1", 0.0, 1))
    table.dispatch(events.remote_blocks("tx-1", 0.0, [5], 0))
    table.dispatch(events.layer_scheduled("tx-1", 0.1, 0))
    before = snapshot(table, "tx-1")
    with pytest.raises(TransitionError, match="guard 'layer_in_flight'") as info:
        table.dispatch(events.layer_write_completed("tx-1", 0.3, 0))
    assert info.value.binding == "layer_in_flight"
    assert snapshot(table, "tx-1") == before


def test_an_interrupt_mid_step_is_rolled_back_and_raised_as_it_is():
    def schedule_layer(tx, ev, out):
        tx.scheduled |= 1 << ev.layer
        raise KeyboardInterrupt

    table = TransferTable(machine_with(schedule_layer))
    table.dispatch(events.prefill_started("tx-1", 0.0, 1))
    before = snapshot(table, "tx-1")
    with pytest.raises(KeyboardInterrupt):
        table.dispatch(events.layer_scheduled("tx-1", 0.1, 0))
    assert snapshot(table, "tx-1") == before


def test_a_failing_timer_step_keeps_its_timer_and_holds_up_no_other():
    def end_expired(tx, ev, out):
        if tx.transfer_id == "tx-1":
            raise RuntimeError("boom")
        tx.end_reason = "expired"

    table = TransferTable(machine_with(end_expired))
    table.dispatch(events.prefill_started("tx-1", 0.0, 1))
    table.dispatch(events.prefill_started("tx-2", 1.0, 1))
    with pytest.raises(TimerStepsFailed) as info:
        table.advance(61.0)
    assert [ev.transfer_id for ev, _ in info.value.fired] == ["tx-2"]  # it fired anyway
    assert table.state_of("tx-2") == "closing"
    assert [e.transfer_id for e in info.value.errors] == ["tx-1"]
    tx = table.get("tx-1")
    assert tx.end_reason == "" and tx.state == "allocated"
    assert tx.deadlines[0] == 121.0  # retried one duration later
    assert table.audit() == []
    assert table.advance(100.0) == []  # not retried in a hot loop


def test_check_mode_rolls_back_a_step_that_breaks_an_invariant():
    def tell_write_done(tx, ev, out):
        tx.write_done_sent += 2  # "sent twice"
        out.append(emits.send_write_done(tx.transfer_id, num_writers=1, decode_rank=0))

    table = TransferTable(machine_with(tell_write_done), check_invariants=True)
    table.dispatch(events.prefill_started("tx-1", 0.0, 1))
    table.dispatch(events.remote_blocks("tx-1", 0.0, [5], 0))
    table.dispatch(events.layer_scheduled("tx-1", 0.1, 0))
    table.dispatch(events.seal("tx-1", 0.2))
    before = snapshot(table, "tx-1")
    with pytest.raises(
        InvariantViolation, match=r"write_done_at_most_once.*'tx-1'.*layer_write_completed"
    ):
        table.dispatch(events.layer_write_completed("tx-1", 0.3, 0))
    assert snapshot(table, "tx-1") == before


def test_check_mode_catches_a_write_the_bytecode_cannot_see():
    def count_completion(tx, ev, out):
        tx.settled |= 1 << ev.layer
        setattr(tx, "end_reason", "sneaky")  # noqa: B010 (a write the bytecode check cannot see; not declared under writes)

    table = TransferTable(machine_with(count_completion), check_invariants=True)
    table.dispatch(events.prefill_started("tx-1", 0.0, 1))
    table.dispatch(events.remote_blocks("tx-1", 0.0, [5], 0))
    table.dispatch(events.layer_scheduled("tx-1", 0.1, 0))
    with pytest.raises(InvariantViolation, match="changed end_reason"):
        table.dispatch(events.layer_write_completed("tx-1", 0.3, 0))
    assert table.get("tx-1").end_reason == ""


def test_check_mode_catches_an_effect_field_of_the_wrong_type():
    def tell_write_done(tx, ev, out):
        tx.write_done_sent += 1
        out.append(emits.send_write_done(tx.transfer_id, num_writers="one", decode_rank=0))

    table = TransferTable(machine_with(tell_write_done), check_invariants=True)
    table.dispatch(events.prefill_started("tx-1", 0.0, 1))
    table.dispatch(events.remote_blocks("tx-1", 0.0, [5], 0))
    table.dispatch(events.layer_scheduled("tx-1", 0.1, 0))
    table.dispatch(events.seal("tx-1", 0.2))
    with pytest.raises(InvariantViolation, match="num_writers='one'.*type int"):
        table.dispatch(events.layer_write_completed("tx-1", 0.3, 0))


def test_an_action_emitting_from_a_row_that_declares_no_emits_is_refused():
    def mark_request_finished(tx, ev, out):
        tx.request_finished = True
        out.append(emits.free_blocks(tx.transfer_id, reason="early"))

    # The bytecode check refuses it when the machine is built...
    with pytest.raises(Exception, match="emits 'free_blocks'"):
        machine_with(mark_request_finished)


def test_a_recorder_that_raises_never_costs_the_step_or_its_effects(caplog):
    def recorder(event, result):
        raise OSError("disk full")

    table = build_table("write_producer", recorder=recorder)
    table.dispatch(events.prefill_started("tx-1", 0.0, 1))
    table.dispatch(events.remote_blocks("tx-1", 0.0, [5], 0))
    with caplog.at_level(logging.ERROR, logger="moriio_fsm.runtime"):
        result = table.dispatch(events.layer_scheduled("tx-1", 0.1, 0))
    assert [e.kind for e in result.effects] == ["post_write"]
    assert table.get("tx-1").posted == 1
    assert table.stats()["recorder_errors"] == 3
    assert "disk full" in caplog.text


def test_generated_steps_show_their_source_in_tracebacks():
    table = TransferTable(machine_with(post_layer))
    table.dispatch(events.prefill_started("tx-1", 0.0, 1))
    table.dispatch(events.remote_blocks("tx-1", 0.0, [5], 0))
    with pytest.raises(TransitionError) as info:
        table.dispatch(events.layer_scheduled("tx-1", 1.0, 2))
    text = "".join(traceback.format_exception(info.value.__cause__))
    assert "step_allocated__layer_scheduled" in text
    # The generated line itself: the inlined body of post_layer, with its origin.
    assert "raise KeyError('engine handle missing')  # action post_layer" in text


def test_check_mode_runs_the_production_code_plus_its_proofs():
    production = build_table("write_producer").generated.source.splitlines()
    checked = build_table("write_producer", check_invariants=True).generated.source.splitlines()
    proofs = [
        line
        for line in checked
        if "verify(" in line
        or "before = tx.context()" in line
        or line.strip() == "out = NO_EFFECTS"
        or "undeclared_read(" in line
        or (line.strip().startswith("if may_fire_") and line.strip().endswith("(tx, ev):"))
    ]
    assert proofs
    assert [line for line in checked if line not in proofs] == production


def test_guards_and_actions_are_inlined_where_exact():
    generated = build_table("write_producer").generated
    assert {
        "new_layer_allocation_known",
        "schedule_layer",
        "post_layer",
        "count_completion",
        "all_writes_succeeded",
    } <= generated.inlined_bindings
    assert "def step_scheduling__layer_scheduled(shard, tx, ev):" in generated.source
    assert "# action post_layer" in generated.source

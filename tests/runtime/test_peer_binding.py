"""A transfer takes peer facts only from the peer its creating event bound it to.

Whoever can reach a listener can send a fact about any transfer id it learns; these tests
send them from the wrong sender, early and late, through both executors and in trace mode,
and check that nothing about the transfer changes while its own peer is still heard.
"""

from __future__ import annotations

import pytest

from moriio_fsm.machines import build_machine
from moriio_fsm.runtime.declared import make_event
from moriio_fsm.runtime.events import Outcome
from moriio_fsm.runtime.table import FIRST_SENDER, TransferTable
from moriio_fsm.trace import TraceRecorder

PRODUCER = build_machine("write_producer")
CONSUMER = build_machine("write_consumer")
BLOCKS = {"block_ids": [1, 2], "decode_rank": 0}
D_HOST, OTHER = "198.18.0.2", "198.18.0.9"


def tables(machine):
    """The same machine through the generated steps, pytransitions, and in trace mode."""
    yield TransferTable(machine)
    yield TransferTable(machine, executor="transitions")
    traced = TransferTable(machine)
    traced.recorder = TraceRecorder("binding-test", ring=64)
    yield traced


def start_producer(table, source=D_HOST, at=1.0):
    return table.dispatch(
        make_event("prefill_started", "tx-1", at, {"num_writers": 1}, source=source)
    )


@pytest.mark.parametrize("table", list(tables(PRODUCER)), ids=["compiled", "transitions", "traced"])
def test_a_fact_from_another_host_changes_nothing_and_is_counted_as_forged(table):
    start_producer(table)
    forged = table.dispatch(make_event("remote_blocks", "tx-1", 2.0, BLOCKS, source=f"{OTHER}#aa"))
    assert forged.outcome is Outcome.FORGED and forged.effects == ()
    assert not table.get("tx-1").has_allocation
    released = table.dispatch(make_event("release", "tx-1", 2.5, source=f"{OTHER}#aa"))
    assert released.outcome is Outcome.FORGED and table.state_of("tx-1") == "allocated"
    real = table.dispatch(make_event("remote_blocks", "tx-1", 3.0, BLOCKS, source=f"{D_HOST}#bb"))
    assert real.outcome is Outcome.APPLIED and table.get("tx-1").has_allocation
    assert table.stats()["outcomes"]["forged"] == 2


def test_a_forged_fact_held_before_the_transfer_existed_is_refused_when_it_is_created():
    table = TransferTable(PRODUCER)
    table.dispatch(make_event("remote_blocks", "tx-1", 0.5, BLOCKS, source=f"{OTHER}#aa"))
    created = start_producer(table)
    assert created.outcome is Outcome.CREATED and created.effects == ()
    assert not table.get("tx-1").has_allocation
    assert table.stats()["outcomes"]["forged"] == 1
    assert table.stats()["outcomes"]["buffered"] == 0  # the held fact left the buffer


def test_the_real_peers_held_fact_is_still_applied_at_creation_beside_a_forged_one():
    table = TransferTable(PRODUCER)
    table.dispatch(
        make_event(
            "remote_blocks", "tx-1", 0.4, {"block_ids": [9], "decode_rank": 0}, source=f"{OTHER}#aa"
        )
    )
    table.dispatch(make_event("remote_blocks", "tx-1", 0.5, BLOCKS, source=f"{D_HOST}#bb"))
    start_producer(table)
    assert table.get("tx-1").remote_block_ids == [1, 2]


def test_a_transfer_may_be_bound_to_several_addresses_of_one_peer():
    table = TransferTable(PRODUCER)
    start_producer(table, source=f"{D_HOST},2001:db8::2")
    assert (
        table.dispatch(
            make_event("remote_blocks", "tx-1", 2.0, BLOCKS, source="2001:db8::2#cc")
        ).outcome
        is Outcome.APPLIED
    )


def test_a_curve_key_is_part_of_the_sender():
    table = TransferTable(PRODUCER)
    start_producer(table, source=f"{D_HOST}/{'ab' * 32}")
    other_key = table.dispatch(
        make_event("remote_blocks", "tx-1", 2.0, BLOCKS, source=f"{D_HOST}/{'cd' * 32}#01")
    )
    no_key = table.dispatch(make_event("remote_blocks", "tx-1", 2.1, BLOCKS, source=f"{D_HOST}#01"))
    assert other_key.outcome is no_key.outcome is Outcome.FORGED
    right = table.dispatch(
        make_event("remote_blocks", "tx-1", 2.2, BLOCKS, source=f"{D_HOST}/{'ab' * 32}#01")
    )
    assert right.outcome is Outcome.APPLIED


def test_bound_to_the_first_sender_the_transfer_keeps_that_one():
    table = serving_table()
    first = table.dispatch(
        make_event("heartbeat", "tx-1", 2.0, {"consumer_rank": 0, "seq": 1}, source=f"{D_HOST}#01")
    )
    assert first.outcome is Outcome.APPLIED
    later = table.dispatch(make_event("release", "tx-1", 3.0, source=f"{OTHER}#02"))
    assert later.outcome is Outcome.FORGED
    assert (
        table.dispatch(make_event("release", "tx-1", 3.1, source=f"{D_HOST}#03")).outcome
        is not Outcome.FORGED
    )


def serving_table():
    """P in READ mode holding its blocks for a D it has not heard from yet."""
    table = TransferTable(build_machine("read_producer"))
    table.dispatch(
        make_event("serve_started", "tx-1", 1.0, {"consumer_tp_size": 1}, source=FIRST_SENDER)
    )
    table.dispatch(make_event("request_finished", "tx-1", 1.1))
    return table


def test_an_unbound_transfer_takes_any_sender_as_before():
    table = TransferTable(PRODUCER)
    start_producer(table, source="")
    assert (
        table.dispatch(
            make_event("remote_blocks", "tx-1", 2.0, BLOCKS, source=f"{OTHER}#aa")
        ).outcome
        is Outcome.APPLIED
    )


@pytest.mark.parametrize("source", [None, 7, b"198.18.0.2", ("198.18.0.2",)])
def test_a_creating_event_whose_binding_is_not_text_is_rejected_and_creates_nothing(source):
    table = TransferTable(PRODUCER)
    result = start_producer(table, source=source)
    assert result.outcome is Outcome.REJECTED and len(table) == 0


@pytest.mark.parametrize("source", [None, 7, b"x#y"])
def test_a_peer_fact_whose_source_is_not_text_is_rejected_not_raised(source):
    table = TransferTable(PRODUCER)
    start_producer(table)
    result = table.dispatch(make_event("remote_blocks", "tx-1", 2.0, BLOCKS, source=source))
    assert result.outcome is Outcome.REJECTED and not table.get("tx-1").has_allocation


def test_a_forged_verdict_cannot_end_a_waiting_load_on_d():
    table = TransferTable(CONSUMER)
    table.dispatch(
        make_event("receive_started", "tx-1", 1.0, {"num_writers": 1}, source="127.0.0.1")
    )
    table.dispatch(make_event("blocks_allocated", "tx-1", 1.1, {"block_ids": [4], "req_id": "d-1"}))
    waiting = table.state_of("tx-1")
    for kind, data in (
        ("write_done", {"num_writers": 1}),
        ("write_failed", {"reason": "x", "writes_stopped": False}),
    ):
        result = table.dispatch(make_event(kind, "tx-1", 2.0, data, source="127.0.0.2#01"))
        assert result.outcome is Outcome.FORGED and result.effects == ()
    assert table.state_of("tx-1") == waiting
    done = table.dispatch(
        make_event("write_done", "tx-1", 3.0, {"num_writers": 1}, source="127.0.0.1#02")
    )
    assert "report_received" in [e.kind for e in done.effects]


def test_a_fact_the_spec_does_not_take_binds_no_one_to_a_first_sender_transfer():
    table = serving_table()
    junk = table.dispatch(
        make_event("heartbeat", "tx-1", 1.5, {"consumer_rank": 0, "seq": -5}, source=f"{OTHER}#01")
    )
    assert junk.outcome is not Outcome.APPLIED
    real = table.dispatch(
        make_event("heartbeat", "tx-1", 2.0, {"consumer_rank": 0, "seq": 1}, source=f"{D_HOST}#02")
    )
    assert real.outcome is Outcome.APPLIED
    assert (
        table.dispatch(make_event("release", "tx-1", 3.0, source=f"{OTHER}#03")).outcome
        is Outcome.FORGED
    )


def test_a_forged_fact_held_before_creation_is_logged_with_its_sender(caplog):
    table = TransferTable(PRODUCER)
    table.dispatch(make_event("remote_blocks", "tx-1", 0.5, BLOCKS, source=f"{OTHER}#aa"))
    with caplog.at_level("WARNING", logger="moriio_fsm.runtime"):
        start_producer(table)
    assert any("tx-1" in r.getMessage() and OTHER in r.getMessage() for r in caplog.records)


def test_an_allocation_from_another_d_engine_is_not_this_transfers_but_its_own_still_is():
    table = TransferTable(PRODUCER)
    table.dispatch(
        make_event(
            "prefill_started", "tx-1", 1.0, {"num_writers": 1, "decode_dp_rank": 0}, source=D_HOST
        )
    )
    other = table.dispatch(
        make_event(
            "remote_blocks", "tx-1", 2.0, {**BLOCKS, "decode_dp_rank": 1}, source=f"{D_HOST}#01"
        )
    )
    assert other.outcome is Outcome.IGNORED and not table.get("tx-1").has_allocation
    own = table.dispatch(
        make_event(
            "remote_blocks", "tx-1", 2.1, {**BLOCKS, "decode_dp_rank": 0}, source=f"{D_HOST}#02"
        )
    )
    assert own.outcome is Outcome.APPLIED and table.get("tx-1").has_allocation

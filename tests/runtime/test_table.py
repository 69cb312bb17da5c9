"""TransferTable rules that hold for every machine: creation, unknown and ended
transfers, the bounded buffer of early peer facts, timers, threads and memory."""

from __future__ import annotations

import threading

import pytest

from moriio_fsm.machines import build_machine, build_table, resolve_config
from moriio_fsm.runtime.compiled import InvariantViolation, TransitionError
from moriio_fsm.runtime.events import Event, Outcome
from moriio_fsm.runtime.table import TransferTable

MACHINE = build_machine("write_producer")
BLOCKS = {"block_ids": [1, 2], "decode_rank": 0}


def new_table(**options) -> TransferTable:
    return TransferTable(MACHINE, **options)


def test_a_peer_message_never_creates_a_transfer_but_waits_for_the_local_side():
    table = new_table()
    early = table.dispatch(Event("tx-1", "remote_blocks", 1.0, BLOCKS))
    assert early.outcome is Outcome.BUFFERED and early.state is None
    assert len(table) == 0 and table.stats()["pending_events"] == 1
    created = table.dispatch(Event("tx-1", "create", 2.0, {"num_writers": 1}))
    assert created.outcome is Outcome.CREATED
    assert table.get("tx-1").has_allocation          # the held fact was applied
    assert table.stats()["pending_events"] == 0
    posted = table.dispatch(Event("tx-1", "layer_scheduled", 2.1, {"layer": 0}))
    assert [e.kind for e in posted.effects] == ["post_writes"]


def test_held_peer_facts_expire_after_their_ttl():
    table = new_table(pending_ttl_s=5.0)
    table.dispatch(Event("tx-1", "remote_blocks", 0.0, BLOCKS))
    table.dispatch(Event("tx-1", "create", 10.0, {"num_writers": 1}))
    assert not table.get("tx-1").has_allocation
    assert table.stats()["outcomes"]["dropped"] == 1


def test_a_flood_of_unknown_ids_cannot_grow_the_buffer():
    table = new_table(shards=4, pending_capacity=64, pending_ttl_s=1000.0)
    outcomes = [table.dispatch(Event(f"junk-{i}", "release", 0.0)).outcome for i in range(5000)]
    assert outcomes.count(Outcome.BUFFERED) <= 64
    assert outcomes.count(Outcome.DROPPED) >= 5000 - 64
    assert table.stats()["pending_events"] <= 64
    assert len(table) == 0


def test_one_id_cannot_hog_the_buffer():
    table = new_table(pending_per_transfer=3)
    outcomes = [table.dispatch(Event("tx-1", "release", 0.0)).outcome for _ in range(10)]
    assert outcomes.count(Outcome.BUFFERED) == 3 and outcomes.count(Outcome.DROPPED) == 7


def test_local_events_for_unknown_transfers_are_counted_not_raised():
    table = new_table()
    result = table.dispatch(Event("nobody", "layer_scheduled", 0.0, {"layer": 0}))
    assert result.outcome is Outcome.UNKNOWN
    assert table.stats()["outcomes"]["unknown"] == 1


def test_ended_ids_stay_bounded_and_a_forgotten_id_still_cannot_come_back():
    table = new_table(shards=1, ended_capacity=8, pending_ttl_s=1.0)
    for i in range(100):
        tid = f"tx-{i}"
        table.dispatch(Event(tid, "create", 0.0, {"num_writers": 1}))
        table.dispatch(Event(tid, "release", 0.0))
        table.dispatch(Event(tid, "request_finished", 0.0))
    stats = table.stats()
    assert stats["live"] == 0 and stats["ended_remembered"] == 8
    assert table.dispatch(Event("tx-99", "remote_blocks", 1.0, BLOCKS)).outcome is Outcome.LATE
    # tx-0 fell out of the record: its late message is held, never creates anything...
    late = table.dispatch(Event("tx-0", "remote_blocks", 1.0, BLOCKS))
    assert late.outcome is Outcome.BUFFERED and len(table) == 0
    # ...and is gone once the buffer's TTL passes.
    for i in range(200):
        table.dispatch(Event(f"junk-{i}", "release", 50.0))
    assert table.state_of("tx-0") is None and len(table) == 0


def test_a_second_create_for_a_live_transfer_is_a_duplicate():
    table = new_table()
    table.dispatch(Event("tx-1", "create", 0.0, {"num_writers": 1}))
    table.dispatch(Event("tx-1", "layer_scheduled", 0.0, {"layer": 2}))
    again = table.dispatch(Event("tx-1", "create", 0.0, {"num_writers": 3}))
    assert again.outcome is Outcome.DUPLICATE
    record = table.get("tx-1")
    assert record.num_writers == 1 and record.num_scheduled == 1


def test_events_the_spec_does_not_handle_in_a_state_are_rejected():
    table = new_table()
    table.dispatch(Event("tx-1", "create", 0.0, {"num_writers": 1}))
    result = table.dispatch(Event("tx-1", "made_up_event", 0.0))
    assert result.outcome is Outcome.REJECTED and result.state == "allocated"


def test_stale_timer_events_are_ignored():
    table = new_table()
    table.dispatch(Event("tx-1", "create", 0.0, {"num_writers": 1}))
    early = table.dispatch(Event("tx-1", "defer_timeout", 1.0))   # deadline is 60 s
    assert early.outcome is Outcome.IGNORED and early.state == "allocated"
    assert table.next_deadline() == 60.0


def test_timer_heap_stays_proportional_to_live_transfers():
    table = new_table()
    for i in range(20000):
        tid = f"tx-{i}"
        table.dispatch(Event(tid, "create", 0.0, {"num_writers": 1}))
        table.dispatch(Event(tid, "release", 0.0))
        table.dispatch(Event(tid, "request_finished", 0.0))
    assert len(table) == 0
    assert table.stats()["timer_entries"] <= 8192


@pytest.mark.parametrize("checked", [False, True])
def test_concurrent_dispatch_and_timers_from_many_threads_keep_every_promise(checked):
    table = build_table("write_producer", check_invariants=checked,
                        config={"transfer_timeout_s": 1000.0})
    transfers = [f"tx-{i}" for i in range(40)]
    layers = 16
    effects: list = []
    lock = threading.Lock()
    stop = threading.Event()

    def record(result):
        with lock:
            effects.extend(result.effects)

    for tid in transfers:
        record(table.dispatch(Event(tid, "create", 0.0, {"num_writers": 1})))
        record(table.dispatch(Event(tid, "remote_blocks", 0.0, BLOCKS)))

    def forward(part):
        for tid in transfers[part::4]:
            for layer in range(layers):
                record(table.dispatch(Event(tid, "layer_scheduled", 0.1, {"layer": layer})))
                record(table.dispatch(Event(tid, "layer_scheduled", 0.1, {"layer": layer})))
            record(table.dispatch(Event(tid, "seal", 0.2)))

    def poller(part):
        for tid in transfers[part::4]:
            for layer in range(layers):
                record(table.dispatch(Event(tid, "write_completed", 0.3, {"layer": layer})))
            record(table.dispatch(Event(tid, "request_finished", 0.4)))

    def ticker():
        # Nothing is due (deadlines are >= 60 s away), but advance races every dispatch.
        while not stop.is_set():
            for _, result in table.advance(30.0):
                record(result)

    clock = threading.Thread(target=ticker)
    clock.start()
    try:
        for phase in (forward, poller):
            threads = [threading.Thread(target=phase, args=(i,)) for i in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(30)
    finally:
        stop.set()
        clock.join(30)
    assert len(table) == 0
    for tid in transfers:
        assert table.state_of(tid) == "released"
        mine = [e for e in effects if e.transfer_id == tid]
        assert [e.kind for e in mine].count("send_write_done") == 1
        assert [e.kind for e in mine].count("free_blocks") == 1
        posted = sorted(layer for e in mine if e.kind == "post_writes" for layer in e.data["layers"])
        assert posted == list(range(layers))
    assert table.stats()["outcomes"]["duplicate"] == len(transfers) * layers


def _rebind(machine, old, new):
    """Swap one bound effect for another in every row of ``machine`` (test helper)."""
    for rows_by_state in (machine.table, machine.eventless):
        for state, rows in rows_by_state.items():
            def swap(row):
                guard, dest, effects, outcome, index = row
                return guard, dest, tuple(new if e is old else e for e in effects), outcome, index
            if isinstance(rows, dict):
                for kind in rows:
                    rows[kind] = tuple(swap(r) for r in rows[kind])
            else:
                rows_by_state[state] = tuple(swap(r) for r in rows)


@pytest.mark.parametrize("checked", [False, True])
def test_a_binding_bug_raises_transition_error_naming_the_transfer(checked):
    from moriio_fsm.machines import write_producer

    def broken(t, ev, out):
        raise KeyError("oops")

    machine = build_machine("write_producer")
    _rebind(machine, write_producer.schedule_layer, broken)
    table = TransferTable(machine, check_invariants=checked)
    table.dispatch(Event("tx-1", "create", 0.0, {"num_writers": 1}))
    with pytest.raises(TransitionError, match=r"tx-1.*allocated.*layer_scheduled.*KeyError"):
        table.dispatch(Event("tx-1", "layer_scheduled", 0.0, {"layer": 0}))


def test_invariant_checking_catches_a_binding_that_breaks_a_rule():
    from moriio_fsm.machines import write_producer

    def send_twice(t, ev, out):
        t.write_done_sent += 2

    machine = build_machine("write_producer")
    _rebind(machine, write_producer.send_write_done, send_twice)
    table = TransferTable(machine, check_invariants=True)
    table.dispatch(Event("tx-1", "create", 0.0, {"num_writers": 1}))
    table.dispatch(Event("tx-1", "remote_blocks", 0.0, BLOCKS))
    table.dispatch(Event("tx-1", "layer_scheduled", 0.0, {"layer": 0}))
    table.dispatch(Event("tx-1", "seal", 0.0))
    with pytest.raises(InvariantViolation, match="write_done_at_most_once"):
        table.dispatch(Event("tx-1", "write_completed", 0.0, {"layer": 0}))


def test_a_live_64_layer_transfer_costs_well_under_2_kib():
    import tracemalloc

    table = new_table()
    table.dispatch(Event("tx-warm", "create", 0.0, {"num_writers": 1}))
    assert not hasattr(table.get("tx-warm"), "__dict__")
    ids = [f"tx-{i:06d}" for i in range(2000)]
    layer_events = [{"layer": layer} for layer in range(64)]
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for tid in ids:
        table.dispatch(Event(tid, "create", 0.0, {"num_writers": 1}))
        table.dispatch(Event(tid, "remote_blocks", 0.0, BLOCKS))
        for data in layer_events:
            table.dispatch(Event(tid, "layer_scheduled", 0.0, data))
        table.dispatch(Event(tid, "seal", 0.0))
    per_transfer = (tracemalloc.get_traced_memory()[0] - before) / len(ids)
    tracemalloc.stop()
    assert len(table) == 2001
    assert per_transfer < 2048


def test_config_overrides_are_checked():
    with pytest.raises(ValueError, match="unknown config key 'defer_timeout'"):
        resolve_config(MACHINE.spec, {"defer_timeout": 3})
    with pytest.raises(ValueError, match="must be a positive number"):
        resolve_config(MACHINE.spec, {"defer_timeout_s": -1})
    with pytest.raises(ValueError, match="unknown engine"):
        build_machine("write_producer", engine="fast")


def test_table_options_are_checked():
    with pytest.raises(ValueError, match="power of two"):
        TransferTable(MACHINE, shards=3)
    with pytest.raises(ValueError, match="pending_capacity"):
        TransferTable(MACHINE, pending_capacity=0)


def test_recorder_sees_every_event_and_result():
    seen = []
    table = new_table(recorder=lambda ev, result: seen.append((ev.kind, result.outcome)))
    table.dispatch(Event("tx-1", "create", 0.0, {"num_writers": 1}))
    table.dispatch(Event("tx-2", "release", 0.0))
    assert seen == [("create", Outcome.CREATED), ("release", Outcome.BUFFERED)]

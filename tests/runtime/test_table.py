"""TransferTable rules that hold for every machine: creation, unknown and ended
transfers, the bounded buffer of early peer facts, timers, threads and memory."""

from __future__ import annotations

import threading

import pytest

from moriio_fsm.machines import build_machine, build_table, resolve_config
from moriio_fsm.runtime.declared import make_event
from moriio_fsm.runtime.events import Event, Outcome
from moriio_fsm.runtime.table import TransferTable

MACHINE = build_machine("write_producer")
BLOCKS = {"block_ids": [1, 2], "decode_rank": 0}


def new_table(**options) -> TransferTable:
    return TransferTable(MACHINE, **options)


def test_a_peer_message_never_creates_a_transfer_but_waits_for_the_local_side():
    table = new_table()
    early = table.dispatch(make_event("remote_blocks", "tx-1", 1.0, BLOCKS))
    assert early.outcome is Outcome.BUFFERED and early.state is None
    assert len(table) == 0 and table.stats()["pending_events"] == 1
    created = table.dispatch(make_event("prefill_started", "tx-1", 2.0, {"num_writers": 1}))
    assert created.outcome is Outcome.CREATED
    assert table.get("tx-1").has_allocation  # the held fact was applied
    assert table.stats()["pending_events"] == 0
    posted = table.dispatch(make_event("layer_scheduled", "tx-1", 2.1, {"layer": 0}))
    assert [e.kind for e in posted.effects] == ["post_write"]


def test_a_result_is_read_by_name_and_does_not_unpack():
    # Four fields read as three would silently drop the hops.
    result = new_table().dispatch(make_event("prefill_started", "tx-1", 1.0, {"num_writers": 1}))
    assert (result.outcome, result.state, result.effects) == (Outcome.CREATED, "allocated", ())
    with pytest.raises(TypeError):
        outcome, state, effects = result


def test_held_peer_facts_expire_after_their_ttl():
    table = new_table(pending_ttl_s=5.0)
    table.dispatch(make_event("remote_blocks", "tx-1", 0.0, BLOCKS))
    table.dispatch(make_event("prefill_started", "tx-1", 10.0, {"num_writers": 1}))
    assert not table.get("tx-1").has_allocation
    assert table.stats()["outcomes"]["dropped"] == 1


def test_a_flood_of_unknown_ids_cannot_grow_the_buffer():
    table = new_table(shards=4, pending_capacity=64, pending_ttl_s=1000.0)
    for i in range(5000):
        table.dispatch(make_event("release", f"junk-{i}", 0.0))
    stats = table.stats()
    # Each event is counted once by its fate: held now, or dropped to make room.
    assert stats["pending_events"] <= 64
    assert stats["outcomes"]["buffered"] == stats["pending_events"]
    assert stats["outcomes"]["dropped"] == 5000 - stats["pending_events"]
    assert len(table) == 0


def test_one_id_cannot_hog_the_buffer():
    table = new_table(pending_per_transfer=3)
    outcomes = [table.dispatch(make_event("release", "tx-1", 0.0)).outcome for _ in range(10)]
    assert outcomes.count(Outcome.BUFFERED) == 3 and outcomes.count(Outcome.DROPPED) == 7


def test_local_events_for_unknown_transfers_are_counted_not_raised():
    table = new_table()
    result = table.dispatch(make_event("layer_scheduled", "nobody", 0.0, {"layer": 0}))
    assert result.outcome is Outcome.UNKNOWN
    assert table.stats()["outcomes"]["unknown"] == 1


def test_ended_ids_stay_bounded_and_a_forgotten_id_still_cannot_come_back():
    table = new_table(shards=1, ended_capacity=8, pending_ttl_s=1.0)
    for i in range(100):
        tid = f"tx-{i}"
        table.dispatch(make_event("prefill_started", tid, 0.0, {"num_writers": 1}))
        table.dispatch(make_event("release", tid, 0.0))
        table.dispatch(make_event("request_finished", tid, 0.0))
    stats = table.stats()
    assert stats["live"] == 0 and stats["ended_remembered"] == 8
    assert table.dispatch(make_event("remote_blocks", "tx-99", 1.0, BLOCKS)).outcome is Outcome.LATE
    # tx-0 fell out of the record: its late message is held, never creates anything...
    late = table.dispatch(make_event("remote_blocks", "tx-0", 1.0, BLOCKS))
    assert late.outcome is Outcome.BUFFERED and len(table) == 0
    # ...and is gone once the buffer's TTL passes.
    for i in range(200):
        table.dispatch(make_event("release", f"junk-{i}", 50.0))
    assert table.state_of("tx-0") is None and len(table) == 0


def test_a_second_create_for_a_live_transfer_is_a_duplicate():
    table = new_table()
    table.dispatch(make_event("prefill_started", "tx-1", 0.0, {"num_writers": 1}))
    table.dispatch(make_event("layer_scheduled", "tx-1", 0.0, {"layer": 2}))
    again = table.dispatch(make_event("prefill_started", "tx-1", 0.0, {"num_writers": 3}))
    assert again.outcome is Outcome.DUPLICATE
    record = table.get("tx-1")
    assert record.num_writers == 1 and record.scheduled == 0b100


def test_events_the_spec_does_not_handle_in_a_state_are_rejected():
    table = new_table()
    table.dispatch(make_event("prefill_started", "tx-1", 0.0, {"num_writers": 1}))
    result = table.dispatch(make_event("writes_abandoned", "tx-1", 0.0))
    assert result.outcome is Outcome.REJECTED and result.state == "allocated"
    kindless = table.dispatch(Event("tx-1", 0.0))  # a plain Event names no kind
    assert kindless.outcome is Outcome.REJECTED and kindless.state == "allocated"


def test_stale_timer_events_are_ignored():
    table = new_table()
    table.dispatch(make_event("prefill_started", "tx-1", 0.0, {"num_writers": 1}))
    early = table.dispatch(make_event("defer_timeout", "tx-1", 1.0))  # deadline is 60 s
    assert early.outcome is Outcome.IGNORED and early.state == "allocated"
    assert table.next_deadline() == 60.0


def test_timer_heap_stays_proportional_to_live_transfers():
    table = new_table()
    for i in range(20000):
        tid = f"tx-{i}"
        table.dispatch(make_event("prefill_started", tid, 0.0, {"num_writers": 1}))
        table.dispatch(make_event("release", tid, 0.0))
        table.dispatch(make_event("request_finished", tid, 0.0))
    assert len(table) == 0
    assert table.stats()["timer_entries"] <= 8192


@pytest.mark.parametrize("checked", [False, True])
def test_concurrent_dispatch_and_timers_from_many_threads_keep_every_promise(checked):
    table = build_table(
        "write_producer", check_invariants=checked, config={"transfer_timeout_s": 1000.0}
    )
    transfers = [f"tx-{i}" for i in range(40)]
    layers = 16
    effects: list = []
    lock = threading.Lock()
    stop = threading.Event()

    def record(result):
        with lock:
            effects.extend(result.effects)

    for tid in transfers:
        record(table.dispatch(make_event("prefill_started", tid, 0.0, {"num_writers": 1})))
        record(table.dispatch(make_event("remote_blocks", tid, 0.0, BLOCKS)))

    def forward(part):
        for tid in transfers[part::4]:
            for layer in range(layers):
                record(table.dispatch(make_event("layer_scheduled", tid, 0.1, {"layer": layer})))
                record(table.dispatch(make_event("layer_scheduled", tid, 0.1, {"layer": layer})))
            record(table.dispatch(make_event("seal", tid, 0.2)))

    def poller(part):
        for tid in transfers[part::4]:
            for layer in range(layers):
                record(
                    table.dispatch(make_event("layer_write_completed", tid, 0.3, {"layer": layer}))
                )
            record(table.dispatch(make_event("request_finished", tid, 0.4)))

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
        posted = sorted(e.layer for e in mine if e.kind == "post_write")
        assert posted == list(range(layers))
    assert table.stats()["outcomes"]["duplicate"] == len(transfers) * layers


def test_a_live_64_layer_transfer_costs_well_under_2_kib():
    import tracemalloc

    table = new_table()
    table.dispatch(make_event("prefill_started", "tx-warm", 0.0, {"num_writers": 1}))
    assert not hasattr(table.get("tx-warm"), "__dict__")
    ids = [f"tx-{i:06d}" for i in range(2000)]
    layer_events = [{"layer": layer} for layer in range(64)]
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for tid in ids:
        table.dispatch(make_event("prefill_started", tid, 0.0, {"num_writers": 1}))
        table.dispatch(make_event("remote_blocks", tid, 0.0, BLOCKS))
        for data in layer_events:
            table.dispatch(make_event("layer_scheduled", tid, 0.0, data))
        table.dispatch(make_event("seal", tid, 0.0))
    per_transfer = (tracemalloc.get_traced_memory()[0] - before) / len(ids)
    tracemalloc.stop()
    assert len(table) == 2001
    assert per_transfer < 2048


def test_config_overrides_are_checked():
    with pytest.raises(ValueError, match="unknown config key 'defer_timeout'"):
        resolve_config(MACHINE.spec, {"defer_timeout": 3})
    with pytest.raises(ValueError, match="must be a positive, finite number"):
        resolve_config(MACHINE.spec, {"defer_timeout_s": -1})
    with pytest.raises(ValueError, match="unknown executor"):
        build_table("write_producer", executor="fast")


def test_table_options_are_checked():
    with pytest.raises(ValueError, match="power of two"):
        TransferTable(MACHINE, shards=3)
    with pytest.raises(ValueError, match="pending_capacity"):
        TransferTable(MACHINE, pending_capacity=0)


def test_recorder_sees_every_event_and_result():
    seen = []
    table = new_table(recorder=lambda ev, result: seen.append((ev.kind, result.outcome)))
    table.dispatch(make_event("prefill_started", "tx-1", 0.0, {"num_writers": 1}))
    table.dispatch(make_event("release", "tx-2", 0.0))
    assert seen == [("prefill_started", Outcome.CREATED), ("release", Outcome.BUFFERED)]

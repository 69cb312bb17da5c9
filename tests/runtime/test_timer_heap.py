"""Timers never get lost and never fire on a clock that is not a number.

Covers the creation-during-compaction race (a new transfer's deadline dropped while
its record says it is armed) single-threaded and with eight threads, and the refusal
of non-finite, non-numeric and non-positive durations and times.
"""

from __future__ import annotations

import math
import threading

import pytest

from moriio_fsm.machines import build_machine, build_table, resolve_config
from moriio_fsm.runtime.declared import events
from moriio_fsm.runtime.events import Outcome
from moriio_fsm.runtime.table import TransferTable

MACHINE = build_machine("write_producer")


def test_creating_transfers_while_every_push_compacts_the_heap_loses_no_deadline():
    table = TransferTable(MACHINE, timer_compaction_threshold=1)
    for i in range(300):
        table._heap._compact_at = 0  # the creation's own push compacts the heap
        table.dispatch(events.prefill_started(f"tx-{i}", 0.0, 1))
        if i % 3 == 0:  # some end at once: their entries go stale
            table.dispatch(events.release(f"tx-{i}", 0.0))
            table.dispatch(events.request_finished(f"tx-{i}", 0.0))
    assert table._heap.compactions >= 300
    assert table.audit() == []
    fired = table.advance(61.0)  # D answered nobody: every defer timer fires
    expired = {ev.transfer_id for ev, result in fired if ev.kind == "defer_timeout"}
    assert expired == {f"tx-{i}" for i in range(300) if i % 3}
    assert all(table.state_of(tid) == "closing" for tid in expired)


def test_eight_threads_creating_during_compactions_lose_no_deadline():
    table = TransferTable(MACHINE, shards=8, timer_compaction_threshold=2)
    barrier = threading.Barrier(8)

    def create(part: int) -> None:
        barrier.wait(10)
        for i in range(400):
            tid = f"tx-{part}-{i}"
            table.dispatch(events.prefill_started(tid, 0.0, 1))
            table.dispatch(events.layer_scheduled(tid, 0.1, 0))

    threads = [threading.Thread(target=create, args=(part,)) for part in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not any(thread.is_alive() for thread in threads)
    assert len(table) == 3200
    assert table.audit() == []
    assert table._heap.compactions > 0
    table.advance(61.0)
    assert all(table.state_of(f"tx-{p}-{i}") == "closing" for p in range(8) for i in range(400))


@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan, 0, -1.0, "30", True, None, [1]])
def test_a_duration_that_is_not_a_positive_finite_number_is_refused_naming_key_and_value(value):
    with pytest.raises(ValueError) as info:
        resolve_config(MACHINE.spec, {"transfer_timeout_s": value})
    assert "transfer_timeout_s" in str(info.value) and repr(value) in str(info.value)
    with pytest.raises(ValueError, match="transfer_timeout_s"):
        build_table("write_producer", config={"transfer_timeout_s": value})


def test_a_limit_must_stay_an_integer():
    with pytest.raises(ValueError, match=r"max_layers.*integer.*64\.5"):
        resolve_config(MACHINE.spec, {"max_layers": 64.5})
    assert resolve_config(MACHINE.spec, {"max_layers": 64})["max_layers"] == 64


@pytest.mark.parametrize("now", [math.nan, math.inf, -math.inf, "61", None, True])
def test_advance_refuses_a_time_that_is_not_a_finite_number(now):
    table = build_table("write_producer")
    table.dispatch(events.prefill_started("tx-1", 0.0, 1))
    with pytest.raises(ValueError, match="advance"):
        table.advance(now)
    assert table.state_of("tx-1") == "allocated"
    assert table.audit() == []


@pytest.mark.parametrize("stamp", [math.nan, math.inf, -math.inf, "0.5", None])
def test_an_event_stamped_with_a_non_finite_time_is_rejected_and_fires_nothing(stamp):
    table = build_table("write_producer", check_invariants=True)
    table.dispatch(events.prefill_started("tx-1", 0.0, 1))
    before = table.get("tx-1").deadlines[:]
    for event in (
        events.defer_timeout("tx-1", stamp),
        events.layer_scheduled("tx-1", stamp, 0),
        events.remote_blocks("tx-1", stamp, [1], 0),
        events.prefill_started("tx-2", stamp, 1),
        events.release("tx-3", stamp),
    ):
        result = table.dispatch(event)
        assert result.outcome is Outcome.REJECTED, event
    assert table.get("tx-1").deadlines == before and table.get("tx-1").scheduled == 0
    assert len(table) == 1 and table.stats()["pending_events"] == 0
    assert table.stats()["outcomes"]["rejected"] == 5
    assert table.next_deadline() == 60.0

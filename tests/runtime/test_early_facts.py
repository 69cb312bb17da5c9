"""Peer facts for transfers not created yet: bounded, fair between peers, O(1) per fact,
and counted once, by their fate.

A stranger's flood of junk ids must neither cost more per event as it goes on nor push
out a real peer's early ``remote_blocks``; a fact held and later applied is one event.
"""

from __future__ import annotations

import pytest

from moriio_fsm.machines import build_machine
from moriio_fsm.runtime.declared import events
from moriio_fsm.runtime.early_facts import EarlyFacts
from moriio_fsm.runtime.events import Outcome
from moriio_fsm.runtime.table import TransferTable

MACHINE = build_machine("write_producer")
BLOCKS = ([3, 4], 0)


def table(**options) -> TransferTable:
    return TransferTable(MACHINE, **options)


def test_a_real_peers_early_allocation_survives_a_flood_of_junk_ids_from_a_stranger():
    t = table(pending_capacity=256, pending_ttl_s=1e9)
    flood = 200_000
    for i in range(flood // 2):
        t.dispatch(events.release(f"junk-{i}", 0.0, source="10.0.0.66#01"))
    assert (
        t.dispatch(events.remote_blocks("tx-real", 0.0, *BLOCKS, source="10.0.0.7#02")).outcome
        is Outcome.BUFFERED
    )
    for i in range(flood // 2, flood):
        t.dispatch(events.release(f"junk-{i}", 0.0, source="10.0.0.66#01"))
    created = t.dispatch(events.prefill_started("tx-real", 1.0, 1))
    assert created.outcome is Outcome.CREATED
    assert t.get("tx-real").has_allocation  # D's answer was not lost
    assert t.stats()["pending_events"] <= 256


def test_a_flood_costs_constant_work_per_fact_whatever_its_size():
    facts = EarlyFacts(capacity=256, per_transfer=8, per_source=64, ttl=1e9)
    for n in (10_000, 100_000):
        before = facts.examined
        for i in range(n):
            facts.hold(events.release(f"junk-{n}-{i}", 0.0, source="flooder"))
        # Each new fact evicts at most one old one (plus amortized tidying).
        assert facts.examined - before <= 2 * n
        assert len(facts) <= 64


def test_many_spoofed_peers_cannot_grow_the_buffer_past_its_capacity():
    t = table(pending_capacity=128, pending_ttl_s=1e9)
    for i in range(20_000):
        t.dispatch(events.release(f"junk-{i}", 0.0, source=f"peer-{i}"))
    stats = t.stats()
    assert stats["pending_events"] <= 128
    assert stats["outcomes"]["buffered"] == stats["pending_events"]
    assert stats["outcomes"]["dropped"] == 20_000 - stats["pending_events"]


def test_the_flooder_loses_its_own_facts_first():
    facts = EarlyFacts(capacity=8, per_transfer=8, per_source=8, ttl=1e9)
    facts.hold(events.remote_blocks("tx-real", 0.0, *BLOCKS, source="decoder"))
    for i in range(100):
        facts.hold(events.release(f"junk-{i}", 0.0, source="flooder"))
    fresh, expired = facts.take("tx-real", 1.0)
    assert [e.kind for e in fresh] == ["remote_blocks"] and expired == 0


def test_a_fact_held_then_applied_is_counted_once():
    t = table()
    t.dispatch(events.remote_blocks("tx-1", 0.0, *BLOCKS))
    t.dispatch(events.release("tx-2", 0.0))
    assert t.stats()["outcomes"]["buffered"] == 2
    t.dispatch(events.prefill_started("tx-1", 1.0, 1))
    outcomes = t.stats()["outcomes"]
    assert outcomes["buffered"] == 1 and outcomes["applied"] == 1 and outcomes["created"] == 1
    assert sum(outcomes.values()) == 3  # three events were dispatched


def test_a_held_fact_older_than_its_ttl_is_dropped_not_applied():
    t = table(pending_ttl_s=5.0)
    t.dispatch(events.remote_blocks("tx-1", 0.0, *BLOCKS))
    t.dispatch(events.prefill_started("tx-1", 10.0, 1))
    assert not t.get("tx-1").has_allocation
    outcomes = t.stats()["outcomes"]
    assert outcomes["dropped"] == 1 and outcomes["buffered"] == 0


def test_one_transfer_id_cannot_hog_the_buffer():
    t = table(pending_per_transfer=3)
    results = [t.dispatch(events.release("tx-1", 0.0)).outcome for _ in range(10)]
    assert results.count(Outcome.BUFFERED) == 3 and results.count(Outcome.DROPPED) == 7


def test_held_facts_apply_in_arrival_order_at_creation():
    t = table()
    t.dispatch(events.release("tx-1", 0.0))
    t.dispatch(events.remote_blocks("tx-1", 0.0, *BLOCKS))
    created = t.dispatch(events.prefill_started("tx-1", 0.1, 1))
    assert created.outcome is Outcome.CREATED
    # The held release applied first and ended the transfer once nothing was in flight.
    assert t.state_of("tx-1") == "closing"
    t.dispatch(events.request_finished("tx-1", 0.2))
    assert t.state_of("tx-1") == "released"


@pytest.mark.parametrize("source", [["not", "hashable"], {"a": 1}])
def test_an_unhashable_source_is_rejected_not_raised(source):
    t = table()
    result = t.dispatch(events.release("tx-1", 0.0, source=source))
    assert result.outcome is Outcome.REJECTED and t.stats()["pending_events"] == 0

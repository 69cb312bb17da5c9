"""Ill-formed events are counted rejections, never exceptions, never state changes.

Whatever an adapter builds by mistake (an unhashable id, a time that is not a number,
a payload of the wrong types, something that is not an event at all), ``dispatch``
answers REJECTED, counts it and leaves every transfer as it was.
"""

from __future__ import annotations

import math

import pytest

from moriio_fsm.machines import build_table
from moriio_fsm.runtime.declared import events
from moriio_fsm.runtime.events import Event, Outcome


@pytest.fixture(params=[1, 8], ids=["one-shard", "eight-shards"])
def table(request):
    table = build_table("write_producer", shards=request.param, check_invariants=True)
    table.dispatch(events.prefill_started("tx-1", 0.0, 1))
    table.dispatch(events.remote_blocks("tx-1", 0.0, [1, 2], 0))
    return table


BAD = [
    pytest.param(lambda: events.layer_scheduled(["tx", 1], 0.1, 0), id="unhashable-id"),
    pytest.param(lambda: events.layer_scheduled({"tx": 1}, 0.1, 0), id="dict-id"),
    pytest.param(lambda: events.layer_scheduled("tx-1", "soon", 0), id="text-time"),
    pytest.param(lambda: events.layer_scheduled("tx-1", None, 0), id="no-time"),
    pytest.param(lambda: events.layer_scheduled("tx-1", math.nan, 0), id="nan-time"),
    pytest.param(lambda: events.layer_scheduled("tx-1", math.inf, 0), id="inf-time"),
    pytest.param(lambda: events.layer_scheduled("tx-1", 0.1, "0"), id="text-layer"),
    pytest.param(lambda: events.layer_scheduled("tx-1", 0.1, [0]), id="list-layer"),
    pytest.param(lambda: events.layer_scheduled("tx-1", 0.1, None), id="no-layer"),
    pytest.param(lambda: events.remote_blocks("tx-1", 0.1, None, 0), id="no-block-ids"),
    pytest.param(lambda: events.remote_blocks("tx-1", 0.1, [1], True), id="bool-rank"),
    pytest.param(lambda: events.release("tx-9", 0.1, source=["x"]), id="unhashable-source"),
    pytest.param(lambda: Event("tx-1", 0.1), id="no-kind"),
    pytest.param(lambda: {"transfer_id": "tx-1", "kind": "seal"}, id="not-an-event"),
    pytest.param(lambda: None, id="none"),
]


@pytest.mark.parametrize("make", BAD)
def test_an_ill_formed_event_is_a_counted_rejection(table, make):
    before = table.get("tx-1").context()
    result = table.dispatch(make())
    assert result.outcome is Outcome.REJECTED
    assert result.effects == ()
    assert table.get("tx-1").context() == before and table.state_of("tx-1") == "allocated"
    assert table.stats()["outcomes"]["rejected"] == 1
    assert table.stats()["pending_events"] == 0 and len(table) == 1
    # The table keeps working.
    assert table.dispatch(events.layer_scheduled("tx-1", 0.2, 0)).outcome is Outcome.APPLIED


class _UnhashableKind(Event):
    kind = ["layer_scheduled"]  # a kind no dict can look up


class _StepLog:
    def __init__(self) -> None:
        self.kinds: list[str] = []

    def bind_table(self, table):
        return lambda ev, before, result, rows, *error: self.kinds.append(ev.kind)


@pytest.mark.parametrize("shards", [1, 8], ids=["one-shard", "eight-shards"])
@pytest.mark.parametrize("recording", ["none", "results", "steps"])
def test_every_dispatch_variant_rejects_an_ill_formed_event_alike(shards, recording):
    # One dispatch path, specialised per shards and recorder: each variant answers an
    # event it cannot look up with the transfer's state, and records nothing of it.
    results_seen: list[str] = []
    steps_seen = _StepLog()
    recorder = {
        "none": None,
        "steps": steps_seen,
        "results": lambda ev, result: results_seen.append(ev.kind),
    }[recording]
    table = build_table("write_producer", shards=shards, recorder=recorder)
    table.dispatch(events.prefill_started("tx-1", 0.0, 1))
    result = table.dispatch(_UnhashableKind("tx-1", 0.1))
    assert (result.outcome, result.state, result.effects) == (Outcome.REJECTED, "allocated", ())
    assert table.stats()["outcomes"]["rejected"] == 1
    assert table.dispatch(events.layer_scheduled("tx-1", 0.2, 0)).outcome is Outcome.APPLIED
    recorded = {"none": [], "results": results_seen, "steps": steps_seen.kinds}[recording]
    assert recorded == ([] if recording == "none" else ["prefill_started", "layer_scheduled"])

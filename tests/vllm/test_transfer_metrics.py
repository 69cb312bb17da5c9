"""The connector's transfer metrics when two threads' results for one transfer arrive in
either order: the live-transfer gauge counts only transfers that have not ended."""

from __future__ import annotations

from types import SimpleNamespace

from moriio_fsm.machines import build_table
from moriio_fsm.runtime.events import Outcome, Result
from moriio_fsm.vllm.metrics import TransferMetrics


def metrics() -> TransferMetrics:
    return TransferMetrics({"receive": build_table("write_consumer").spec})


def step(tid: str, outcome: Outcome, hops) -> tuple:
    return SimpleNamespace(transfer_id=tid), Result(outcome, hops[-1][1], [], tuple(hops))


CREATED = [(None, "awaiting_allocation")]
ENDED = [("awaiting_allocation", "waiting"), ("waiting", "received")]


def test_a_transfer_counts_as_live_until_its_end_is_folded_in():
    m = metrics()
    m.observe("receive", *step("tx-1", Outcome.CREATED, CREATED), now=1.0)
    assert m.snapshot()["live"] == 1
    m.observe("receive", *step("tx-1", Outcome.APPLIED, ENDED), now=2.0)
    data = m.snapshot()
    assert data["live"] == 0 and data["transfers"] == {"completed": 1}


def test_a_creation_folded_in_after_the_end_leaves_nothing_live():
    m = metrics()
    for i in range(100):
        m.observe("receive", *step(f"tx-{i}", Outcome.APPLIED, ENDED), now=2.0)
        m.observe("receive", *step(f"tx-{i}", Outcome.CREATED, CREATED), now=1.0)
    data = m.snapshot()
    assert data["live"] == 0 and data["transfers"] == {"completed": 100}


def test_the_record_of_ended_ids_stays_bounded():
    m = TransferMetrics({"receive": build_table("write_consumer").spec}, max_live=8)
    for i in range(1000):
        m.observe("receive", *step(f"tx-{i}", Outcome.APPLIED, ENDED), now=2.0)
    assert len(m._ended_ids) == 8

"""The driver runs every effect through its handler and never loses a transfer.

It refuses to start with a handler missing or unknown, runs handlers with no lock held
(a handler may dispatch into the same table), feeds back the events handlers return,
and turns a handler that raises into the emit's declared on_failure event.
"""

from __future__ import annotations

import logging
import threading

import pytest

from moriio_fsm.machines import build_table
from moriio_fsm.runtime.declared import events
from moriio_fsm.runtime.driver import Driver, DriverError

KINDS = (
    "post_write",
    "abandon_writes",
    "send_write_done",
    "send_write_failed",
    "free_blocks",
    "quarantine_blocks",
)


def recording(log: list):
    return {kind: (lambda effect, kind=kind: log.append(effect)) for kind in KINDS}


def started(driver: Driver, tid: str = "tx-1", layers: int = 2) -> None:
    driver.dispatch(events.prefill_started(tid, 0.0, 1))
    driver.dispatch(events.remote_blocks(tid, 0.0, [4, 5], 0))
    for layer in range(layers):
        driver.dispatch(events.layer_scheduled(tid, 0.1, layer))
    driver.dispatch(events.seal(tid, 0.2))


def test_a_driver_refuses_to_start_without_a_handler_for_every_declared_kind():
    table = build_table("write_producer")
    handlers = recording([])
    del handlers["abandon_writes"], handlers["quarantine_blocks"]
    with pytest.raises(DriverError, match="abandon_writes, quarantine_blocks"):
        Driver(table, handlers)


def test_a_driver_refuses_handlers_for_kinds_the_spec_does_not_emit():
    handlers = recording([])
    handlers["post_writes"] = lambda effect: None
    with pytest.raises(DriverError, match="post_writes.*does not emit"):
        Driver(build_table("write_producer"), handlers)
    handlers = recording([])
    handlers["free_blocks"] = "not callable"
    with pytest.raises(DriverError, match="free_blocks.*not callable"):
        Driver(build_table("write_producer"), handlers)


def test_effects_reach_their_handlers_in_the_order_the_steps_emitted_them():
    log: list = []
    driver = Driver(build_table("write_producer", check_invariants=True), recording(log))
    started(driver)
    for layer in range(2):
        driver.dispatch(events.layer_write_completed("tx-1", 0.3, layer))
    driver.dispatch(events.request_finished("tx-1", 0.4))
    assert [e.kind for e in log] == ["post_write", "post_write", "send_write_done", "free_blocks"]
    assert [e.layer for e in log[:2]] == [0, 1]


def test_handlers_run_with_no_lock_held_and_may_dispatch_into_the_same_table():
    log: list = []
    handlers = recording(log)
    holder: dict = {}

    def post_write(effect):
        # A synchronous engine: the write lands before the post call returns.
        holder["driver"].dispatch(
            events.layer_write_completed(effect.transfer_id, 0.3, effect.layer)
        )

    handlers["post_write"] = post_write
    driver = holder["driver"] = Driver(build_table("write_producer"), handlers)
    done = threading.Event()

    def run():
        started(driver)
        driver.dispatch(events.request_finished("tx-1", 0.4))
        done.set()

    threading.Thread(target=run, daemon=True).start()
    assert done.wait(10), "a handler deadlocked: the driver held a lock while running it"
    assert driver.table.state_of("tx-1") == "released"


def test_events_a_handler_returns_are_dispatched_after_the_pending_effects():
    log: list = []
    handlers = recording(log)
    handlers["abandon_writes"] = lambda effect: [events.writes_abandoned(effect.transfer_id, 40.0)]
    driver = Driver(build_table("write_producer"), handlers)
    started(driver)
    steps = driver.advance(31.0)  # the writes stalled: torn down
    kinds = [ev.kind for ev, _ in steps]
    assert kinds == ["transfer_timeout", "writes_abandoned"]
    assert driver.table.state_of("tx-1") == "closing"
    assert [e.kind for e in log][-1] == "send_write_failed"


def test_a_failed_post_becomes_post_failed_for_that_layer():
    log: list = []
    handlers = recording(log)

    def post_write(effect):
        if effect.layer == 1:
            raise OSError("engine refused the batch")
        log.append(effect)

    handlers["post_write"] = post_write
    driver = Driver(build_table("write_producer", check_invariants=True), handlers)
    started(driver)
    tx = driver.table.get("tx-1")
    assert tx.state == "draining" and tx.failed == 0b10 and tx.end_reason == "failed"
    assert driver.stats()["handler_failures"] == {"post_write": 1}
    steps = driver.dispatch(events.layer_write_completed("tx-1", 0.3, 0))
    assert [e.kind for _, r in steps for e in r.effects] == ["send_write_failed"]


def test_a_failed_message_to_d_is_reported_to_the_transfer_and_it_still_ends(caplog):
    log: list = []
    handlers = recording(log)

    def send_write_done(effect):
        raise ConnectionError("outbox full")

    handlers["send_write_done"] = send_write_done
    driver = Driver(build_table("write_producer"), handlers)
    started(driver, layers=1)
    with caplog.at_level(logging.WARNING, logger="moriio_fsm.driver"):
        steps = driver.dispatch(events.layer_write_completed("tx-1", 0.3, 0))
    assert [ev.kind for ev, _ in steps] == ["layer_write_completed", "notify_failed"]
    assert steps[1][0].error == "ConnectionError: outbox full"
    assert driver.table.get("tx-1").notify_failures == 1
    assert "outbox full" in caplog.text
    driver.dispatch(events.request_finished("tx-1", 0.4))
    assert driver.table.state_of("tx-1") == "released"


def test_a_failing_handler_of_a_final_effect_is_counted_and_logged(caplog):
    log: list = []
    handlers = recording(log)

    def free_blocks(effect):
        raise RuntimeError("allocator gone")

    handlers["free_blocks"] = free_blocks
    driver = Driver(build_table("write_producer"), handlers)
    driver.dispatch(events.prefill_started("tx-1", 0.0, 1))
    driver.dispatch(events.release("tx-1", 0.0))
    with caplog.at_level(logging.ERROR, logger="moriio_fsm.driver"):
        driver.dispatch(events.request_finished("tx-1", 0.1))
    assert driver.stats() == {"handler_failures": {"free_blocks": 1}, "unreported_failures": 1}
    assert "allocator gone" in caplog.text

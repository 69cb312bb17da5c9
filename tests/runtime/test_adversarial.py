"""Attacks on the runtime that once worked, each kept as a test.

Each test states the promise it attacks: bindings whose inlined form must mean what the
called form means, effects that must not leak between transfers, timers and clocks
that must not be fooled, drivers and recorders that must not lose or hang anything.
"""

from __future__ import annotations

import logging
import threading
from decimal import Decimal

import pytest

from moriio_fsm.lang.loader import parse_spec
from moriio_fsm.machines import build_machine, build_table, write_producer
from moriio_fsm.runtime.bindings import Bindings
from moriio_fsm.runtime.declared import effect_class, emits, events
from moriio_fsm.runtime.driver import Driver
from moriio_fsm.runtime.errors import InvariantViolation, TimerStepsFailed, TransitionError
from moriio_fsm.runtime.events import Outcome
from moriio_fsm.runtime.machine import Machine
from moriio_fsm.runtime.table import TransferTable

BASE = build_machine("write_producer")
LIMIT = 7


def machine_with(*replacements, config=None) -> Machine:
    """The write producer with some bindings replaced by same-named functions."""
    return Machine(
        BASE.spec, write_producer.bindings.replaced(*replacements), config or BASE.config
    )


def both(machine, evs, **options):
    """The same events through both executors: their traces and final contexts."""
    traces = []
    for executor in ("compiled", "transitions"):
        table = TransferTable(machine, executor=executor, **options)
        trace = []
        for ev in evs:
            try:
                r = table.dispatch(ev)
                trace.append((ev.kind, r.outcome, r.state, r.effects))
            except TransitionError as exc:
                trace.append((ev.kind, "raised", str(exc).split(":")[1][:30]))
        tx = table.get(evs[0].transfer_id)
        trace.append(tx.context() if tx else None)
        traces.append(trace)
    return traces


def started(tid="t"):
    return [events.prefill_started(tid, 0.0, 1), events.remote_blocks(tid, 0.1, [7], 0)]


# -- effects never leak ----------------------------------------------------------------


def count_notify_failure(tx, ev, out):
    tx.notify_failures += 1
    out.extend([effect_class("free_blocks")(tx.transfer_id, reason="x")])


def test_an_effect_slipped_into_a_row_without_emits_is_refused_and_leaks_nowhere():
    machine = machine_with(count_notify_failure)
    for executor in ("compiled", "transitions"):
        table = TransferTable(machine, executor=executor)
        table.dispatch(events.prefill_started("t", 0.0, 1))
        table.dispatch(events.release("t", 0.1))
        with pytest.raises(TransitionError, match="declares no emits"):
            table.dispatch(events.notify_failed("t", 0.2, "e"))
        table.dispatch(events.prefill_started("u", 1.0, 1))
        assert table.dispatch(events.layer_scheduled("u", 1.1, 0)).effects == ()


# -- inlined means the same as called ----------------------------------------------------

out = 7  # a module global named like a step's own local


def layer_is_new(tx, ev):
    layer = ev.layer
    return (
        type(layer) is int
        and 0 <= layer < tx.max_layers
        and not (tx.scheduled >> layer) & 1
        and out == 7
    )


def layer_already_scheduled(tx, ev):
    layer = ev.layer
    return (
        type(layer) is int
        and 0 <= layer < tx.max_layers
        and (tx.scheduled >> layer) & 1 == 1
        and layer < LIMIT
    )


def test_globals_named_like_step_locals_or_changed_later_mean_the_same_inlined():
    global LIMIT
    machine = machine_with(layer_is_new, layer_already_scheduled)
    evs = [
        events.prefill_started("t", 0.0, 1),
        events.layer_scheduled("t", 0.1, 3),
        events.layer_scheduled("t", 0.2, 3),
    ]
    compiled, reference = both(machine, evs)
    assert compiled == reference
    assert compiled[2][1] is Outcome.DUPLICATE
    LIMIT = 2  # a global the binding reads, changed live
    try:
        compiled, reference = both(machine, evs)
        assert compiled == reference and compiled[2][1] is Outcome.REJECTED
    finally:
        LIMIT = 7


def finished_after_abort(tx, ev):
    share = 1 // (not (tx.end_reason == "failed" and tx.request_finished))
    return tx.end_reason == "aborted" and tx.request_finished and share == 1


def test_eventless_guards_run_in_order_as_they_would_when_called():
    evs = started() + [
        events.layer_scheduled("t", 0.2, 0),
        events.layer_write_failed("t", 0.3, 0, 1),
        events.request_finished("t", 0.4),
    ]
    compiled, reference = both(machine_with(finished_after_abort), evs)
    assert compiled == reference and compiled[-2][2] == "failed"


def tell_write_failed(tx, ev, out):
    tx.write_failed_sent += 1
    out.append(
        emits.send_write_failed(
            tx.transfer_id,
            reason=f"{tx.end_reason} in {tx.state}",
            decode_rank=tx.decode_rank,
            writes_stopped=True,
        )
    )


def test_actions_see_the_source_state_in_both_executors():
    compiled, reference = both(
        machine_with(tell_write_failed),
        [events.prefill_started("t", 0.0, 1), events.release("t", 0.1)],
    )
    assert compiled == reference
    assert compiled[1][3][0].reason == "released in draining"


def _gave_up_on_d(record):
    return record.notify_failures > 0


def finished_after_release(tx, ev):
    return tx.end_reason == "released" and (tx.request_finished or _gave_up_on_d(tx))


def test_check_mode_catches_a_guard_reading_an_undeclared_field_through_a_helper():
    table = TransferTable(machine_with(finished_after_release), check_invariants=True)
    table.dispatch(events.prefill_started("t", 0.0, 1))
    table.dispatch(events.release("t", 0.1))
    with pytest.raises(InvariantViolation, match="reads a field its spec entry does not declare"):
        table.dispatch(events.notify_failed("t", 0.2, "x"))


def test_generated_functions_get_unique_names():
    text = """
name: collide
initial: a
config: {t_s: {default: 5.0}}
context: {n: {type: int, initial: 0}}
states: {a: {doc: start}, a__b: {doc: middle}, ok: {final: true}, bad: {final: true}}
events: {begin_co: {origin: local, creates: true}, go: {origin: local}, b__c: {origin: local},
         c: {origin: local}, tick: {origin: timer}}
actions: {bump: {writes: [n]}}
timers: {guard_timer: {states: [a, a__b], duration: t_s, event: tick}}
transitions:
  - {event: begin_co, source: a, internal: true, actions: [bump]}
  - {event: go, source: a, dest: a__b, actions: [bump]}
  - {event: b__c, source: a, dest: ok, actions: [bump]}
  - {event: c, source: a__b, dest: bad, actions: [bump]}
  - {event: tick, source: [a, a__b], dest: bad, actions: [bump]}
"""
    spec = parse_spec(text, "collide.yaml")
    bindings = Bindings("collide")

    def bump(tx, ev, out):
        tx.n += 1

    bindings.action(bump)
    machine = Machine(spec, bindings, spec.default_config())
    table = TransferTable(machine)
    table.dispatch(events.begin_co("x", 0.0))
    assert table.dispatch(events.b__c("x", 0.1)).state == "ok"


# -- clocks and ids ------------------------------------------------------------------------


@pytest.mark.parametrize("stamp", [1j, Decimal(1), 10**400, True])
def test_a_time_that_is_not_a_float_or_int_clock_reading_is_rejected(stamp):
    table = build_table("write_producer")
    assert table.dispatch(events.prefill_started("a", stamp, 1)).outcome is Outcome.REJECTED
    assert table.dispatch(events.prefill_started("b", 0.0, 1)).outcome is Outcome.CREATED
    assert table.advance(100.0) != [] and table.audit() == []
    with pytest.raises(ValueError):
        table.advance(10**400)


@pytest.mark.parametrize("tid", [True, 1, 1.0, b"tx"])
def test_an_id_that_is_not_a_string_is_rejected(tid):
    table = build_table("write_producer")
    assert table.dispatch(events.prefill_started(tid, 0.0, 1)).outcome is Outcome.REJECTED
    assert len(table) == 0


def test_an_event_stamped_earlier_never_leaves_a_deadline_before_its_heap_entry():
    table = build_table("write_producer")
    table.dispatch(events.prefill_started("a", 0.0, 1))
    table.dispatch(events.layer_scheduled("a", 10.0, 0))
    table.dispatch(events.layer_scheduled("a", 9.999, 1))
    assert table.audit() == []


# -- one broken transfer never costs the others ---------------------------------------------


def end_expired(tx, ev, out):
    if tx.transfer_id == "B":
        raise ValueError("bug for B only")
    tx.end_reason = "expired"


def test_a_timer_step_that_raises_holds_up_no_other_and_its_effects_are_carried_out():
    table = TransferTable(machine_with(end_expired))
    done: list = []
    driver = Driver(table, {k: done.append for k in table.spec.emits})
    driver.dispatch(events.prefill_started("A", 0.0, 1))
    driver.dispatch(events.layer_scheduled("A", 0.0, 0))
    driver.dispatch(events.request_finished("A", 0.0))
    driver.dispatch(events.prefill_started("B", 1.0, 1))
    driver.dispatch(events.prefill_started("C", 2.0, 1))
    with pytest.raises(TimerStepsFailed):
        driver.advance(100.0)
    assert table.state_of("A") == "expired" and table.state_of("C") == "closing"
    assert [e.kind for e in done] == ["send_write_failed", "free_blocks", "send_write_failed"]


def end_released(tx, ev, out):
    raise ValueError("bug")


def test_a_held_fact_that_breaks_at_creation_is_rejected_and_the_transfer_still_made(caplog):
    table = TransferTable(machine_with(end_released))
    table.dispatch(events.remote_blocks("T", 0.0, [1], 0, source="d"))
    table.dispatch(events.release("T", 0.1, source="d"))
    with caplog.at_level(logging.ERROR, logger="moriio_fsm.runtime"):
        created = table.dispatch(events.prefill_started("T", 0.2, 1))
    assert created.outcome is Outcome.CREATED and table.get("T").has_allocation
    outcomes = table.stats()["outcomes"]
    assert sum(outcomes.values()) == 3 and outcomes["rejected"] == 1
    assert "could not be applied at creation" in caplog.text


def test_a_handler_whose_events_fail_to_come_is_a_handler_failure():
    def lazy_failure(effect):
        raise ConnectionError("socket closed")
        yield

    for handler in (lazy_failure, lambda effect: True, lambda effect: [1]):
        table, done = build_table("write_producer"), []
        handlers = {k: (lambda e: done.append(e.kind)) for k in table.spec.emits}  # noqa: B023 (called within this iteration)
        handlers["send_write_failed"] = handler
        driver = Driver(table, handlers)
        driver.dispatch(events.prefill_started("a", 0.0, 1))
        steps = driver.dispatch(events.request_finished("a", 0.1))
        assert table.state_of("a") == "failed" and "free_blocks" in done
        assert driver.stats()["handler_failures"] == {"send_write_failed": 1}
        assert steps[-1][0].kind == "notify_failed"


def test_a_recorder_that_dispatches_is_refused_not_a_deadlock():
    holder: dict = {}

    def recorder(ev, result):
        holder["table"].dispatch(events.seal(ev.transfer_id, ev.time))

    table = holder["table"] = build_table("write_producer", recorder=recorder)
    finished = threading.Event()

    def run():
        table.dispatch(events.prefill_started("a", 0.0, 1))
        finished.set()

    threading.Thread(target=run, daemon=True).start()
    assert finished.wait(10)
    assert table.stats()["recorder_errors"] == 1


# -- the early-fact buffer cannot be gamed ---------------------------------------------------


def test_one_host_posing_as_many_peers_cannot_push_out_a_real_peers_fact():
    table = build_table("write_producer", pending_capacity=64)
    table.dispatch(events.remote_blocks("X", 0.0, [1], 0, source="10.0.0.2#aa"))
    for i in range(1000):
        table.dispatch(
            events.remote_blocks(f"junk{i}", 0.001 * i, [0], 0, source=f"10.0.0.9#{i:04x}")
        )
    table.dispatch(events.prefill_started("X", 1.0, 1))
    assert table.get("X").has_allocation


def test_a_flooder_filling_one_transfers_slots_gives_way_to_a_real_peer():
    from moriio_fsm.runtime.early_facts import EarlyFacts

    facts = EarlyFacts(capacity=64, per_transfer=8, per_source=16, ttl=1e9)
    for _ in range(8):
        facts.hold(events.release("Y", 0.0, source="10.0.0.9#ee"))
    kept, evicted = facts.hold(events.remote_blocks("Y", 0.1, [1], 0, source="10.0.0.2#aa"))
    assert kept and evicted == 1
    fresh, _ = facts.take("Y", 0.2)
    assert [e.kind for e in fresh].count("remote_blocks") == 1 and len(fresh) == 8


def schedule_layer(tx, ev, out):
    raise ValueError("boom")


def test_both_executors_name_the_binding_and_row_that_raised():
    for executor in ("compiled", "transitions"):
        table = TransferTable(machine_with(schedule_layer), executor=executor)
        table.dispatch(events.prefill_started("t", 0.0, 1))
        with pytest.raises(TransitionError) as info:
            table.dispatch(events.layer_scheduled("t", 0.1, 0))
        assert info.value.binding == "schedule_layer", executor
        assert "action 'schedule_layer' of transition #" in str(info.value)

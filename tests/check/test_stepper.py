"""The stepper runs exactly the table's steps: random walks through a live table (dispatch
and advance) and through the stepper's copies must agree on every state, context field,
deadline and effect, and the copies must leave the originals untouched."""

from __future__ import annotations

import random

import pytest

from moriio_fsm.check.alphabet import Alphabet
from moriio_fsm.check.bounds import Bounds
from moriio_fsm.check.stepper import TRANSFER_ID, Stepper
from moriio_fsm.machines import MACHINE_MODULES, build_machine
from moriio_fsm.runtime.table import TransferTable


def walk(name: str, seed: int, steps: int = 60) -> None:
    machine = build_machine(name)
    alphabet = Alphabet(machine.spec, Bounds(layers=2, writers=2))
    rng = random.Random(seed)
    table = TransferTable(machine, check_invariants=True)
    stepper = Stepper(machine)
    start = rng.choice(alphabet.creating)
    live = table.dispatch(start.build(TRANSFER_ID, 0.0))
    if live.state is None:
        return
    _, key = stepper.create(start.build(TRANSFER_ID, 0.0))
    now = 0.0
    for _ in range(steps):
        tx = table.get(TRANSFER_ID)
        if tx is None:
            break  # ended: the table retired it
        assert stepper.key_of(tx) == key
        armed = [d for d in tx.deadlines if d is not None]
        if armed and rng.random() < 0.3:
            now = min(armed)
            fired = table.advance(now)
            timer_events = [timer.event for timer in machine.spec.timers.values()]
            for ev, result in fired:
                slot = timer_events.index(ev.kind)
                replayed, key = stepper.run(stepper.load(key), stepper.timer_event(slot, ev.time))
                assert (replayed.outcome, replayed.state, list(replayed.effects)) == (
                    result.outcome,
                    result.state,
                    list(result.effects),
                )
            continue
        concrete = rng.choice(alphabet.events)
        ev = concrete.build(TRANSFER_ID, now)
        original = stepper.load(key)
        snapshot = stepper.key_of(original)
        expected = table.dispatch(ev)
        got, key = stepper.run(original, ev)
        assert stepper.key_of(original) == snapshot  # the copy took the step
        assert (got.outcome, got.state, list(got.effects)) == (
            expected.outcome,
            expected.state,
            list(expected.effects),
        ), concrete


@pytest.mark.parametrize("name", sorted(MACHINE_MODULES))
@pytest.mark.parametrize("seed", range(8))
def test_the_stepper_takes_the_tables_steps(name, seed):
    walk(name, seed)


def test_keys_hold_lists_as_tuples_and_give_them_back_as_lists():
    machine = build_machine("write_producer")
    stepper = Stepper(machine)
    _, key = stepper.create(Alphabet(machine.spec, Bounds()).creating[0].build(TRANSFER_ID, 0.0))
    alphabet = Alphabet(machine.spec, Bounds())
    blocks = next(
        c for c in alphabet.events if c.kind == "remote_blocks" and dict(c.data)["decode_rank"] == 0
    )
    _, key = stepper.run(stepper.load(key), blocks.build(TRANSFER_ID, 0.0))
    hash(key)
    assert stepper.context_of(key)["remote_block_ids"] == [7]
    assert type(stepper.load(key).remote_block_ids) is list

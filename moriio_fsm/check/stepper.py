"""Runs the real runtime's steps on copies of transfer records, one event at a time.

Rules: every step is the step a check-mode ``TransferTable`` of the machine runs (the
generated steps with their timer and creation wrappers, eventless rows, timer rules,
invariants and declarations verified after every row), never a re-implementation. A
record is kept as a hashable *key* (state, deadlines, context values); a step runs on a
fresh copy and the table keeps nothing of it. This is the one module of the checker that
reaches into the table, because the table has no public way to run a step on a record
it does not hold; ``tests/check/test_stepper.py`` holds it to ``dispatch``.
"""

from __future__ import annotations

import logging
import operator
from typing import Any

import msgspec

from ..runtime.events import Event, Outcome
from ..runtime.machine import Machine, copy_record
from ..runtime.table import Result, TransferTable

#: The transfer id every explored record carries.
TRANSFER_ID = "tx-check"

_REJECTED = Outcome.REJECTED
#: Records kept by ``Stepper.load``: a search loads the same few keys again and again.
_LOADED_KEPT = 4096


class _QuietAboutCheckedTransfers(logging.Filter):
    """Drops the table's log records about the checker's own transfers: a search retires
    thousands of them in anomaly states on purpose, which is no news to anyone."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        return not any(isinstance(a, str) and a.startswith(TRANSFER_ID) for a in args)


_quiet = _QuietAboutCheckedTransfers()


class FrozenList(tuple):
    """A list held in a key (keys must be hashable); it turns back into a list."""

    __slots__ = ()


def _freeze(value: Any) -> Any:
    if type(value) is list:
        return FrozenList(_freeze(v) for v in value)
    return value


def _thaw(value: Any) -> Any:
    if type(value) is FrozenList:
        return [_thaw(v) for v in value]
    return value


class Stepper:
    """One machine's steps, run on records rebuilt from keys.

    A key is ``(state, deadlines, *context values)``; ``load(key)`` gives a record and
    ``run(record, event)`` a ``(Result, key)`` after the step, leaving ``record`` as it
    was. ``InvariantViolation`` and ``TransitionError`` pass through: the step was rolled
    back and the caller reports it.
    """

    def __init__(self, machine: Machine):
        runtime_log = logging.getLogger("moriio_fsm.runtime")
        if _quiet not in runtime_log.filters:
            runtime_log.addFilter(_quiet)
        self.machine = machine
        self.table = TransferTable(machine, check_invariants=True)
        self.fields = machine.record_class.field_names
        self.final = machine.final
        self._record_class = machine.record_class
        self._shard = self.table._shards[0]
        self._steps = self.table._steps
        self._get_context = operator.attrgetter(*self.fields) if len(self.fields) > 1 else None
        self._unhashable = tuple(
            index
            for index, name in enumerate(self.fields)
            if machine.spec.context[name].type == "object"
        )
        self._no_deadlines = (None,) * len(machine.spec.timers)
        self._timer_events = tuple(
            machine.event_classes[timer.event] for timer in machine.spec.timers.values()
        )
        self._created = 0
        self._loaded: dict[tuple, Any] = {}
        self._creations: dict[tuple, tuple] = {}

    # -- keys --------------------------------------------------------------------------

    def key_of(self, tx) -> tuple:
        if self._get_context is None:
            values: tuple = tuple(getattr(tx, name) for name in self.fields)
        else:
            values = self._get_context(tx)
        if self._unhashable:
            frozen = list(values)
            for index in self._unhashable:
                frozen[index] = _freeze(frozen[index])
            return (tx.state, tuple(tx.deadlines), *frozen)
        return (tx.state, tuple(tx.deadlines), *values)

    def load(self, key: tuple):
        """The record of ``key``. Callers must not change it: it is kept for the next
        ``load`` of the same key (``run`` steps on a copy)."""
        tx = self._loaded.get(key)
        if tx is not None:
            return tx
        if len(self._loaded) >= _LOADED_KEPT:
            self._loaded.clear()
        tx = object.__new__(self._record_class)  # no __init__: the key gives every field
        tx.transfer_id = TRANSFER_ID
        tx.state = key[0]
        tx.deadlines = list(key[1])
        tx._senders = None  # peers are not modelled: every transfer takes any sender
        for name, value in zip(self.fields, key[2:]):
            setattr(tx, name, value)
        for index in self._unhashable:
            setattr(tx, self.fields[index], _thaw(key[2 + index]))
        self._loaded[key] = tx
        return tx

    @staticmethod
    def state_of(key: tuple) -> str:
        return key[0]

    @staticmethod
    def deadlines_of(key: tuple) -> tuple:
        return key[1]

    def context_of(self, key: tuple) -> dict[str, Any]:
        return {name: _thaw(value) for name, value in zip(self.fields, key[2:])}

    # -- steps -------------------------------------------------------------------------

    def create(self, ev: Event) -> tuple[Result, tuple | None]:
        """Dispatch a creating event to the table; the new transfer's key, or None when
        the spec refused it. The same event at the same time is dispatched once: the
        table keeps every transfer it created."""
        seen = (ev.kind, ev.time, tuple((n, _freeze(v)) for n, v in ev.data.items()))
        known = self._creations.get(seen)
        if known is None:
            known = self._creations[seen] = self._create(ev)
        return known

    def _create(self, ev: Event) -> tuple[Result, tuple | None]:
        self._created += 1
        tid = f"{TRANSFER_ID}#{self._created}"
        # A table transfer id of its own per creation: the table keeps what it created.
        result = self.table.dispatch(msgspec.structs.replace(ev, transfer_id=tid))
        if result.outcome is not Outcome.CREATED:
            return result, None
        tx = self.table.get(tid)
        if tx is None:
            tx = self._ended_in_creation(msgspec.structs.replace(ev, transfer_id=tid))
        copy = copy_record(tx)
        copy.transfer_id = TRANSFER_ID
        key = self.key_of(copy)
        return result, key

    def _ended_in_creation(self, ev: Event):
        """The record of a transfer that ended in the step creating it. The table retired
        it at once, keeping only its state, so the same creating step runs again on a fresh
        record (a step depends on its record and event alone) and that record is kept."""
        tx = self._record_class(ev.transfer_id)
        tx._senders = None
        try:
            self.table._creating_steps[ev.kind](self._shard, tx, ev)
        finally:
            tx.deadlines[:] = self._no_deadlines
        return tx

    def run(self, tx, ev: Event) -> tuple[Result, tuple]:
        """Run ``ev``'s step on a copy of ``tx``; the result and the key after it."""
        copy = copy_record(tx)
        step = self._steps[copy.state].get(ev.kind)
        if step is None:
            return Result(_REJECTED, copy.state, ()), self.key_of(copy)
        try:
            result = step(self._shard, copy, ev)
            return result, self.key_of(copy)
        finally:
            # The table pushed a heap entry for every timer it armed on the copy; an
            # unarmed slot lets compaction drop them, so the heap stays small.
            copy.deadlines[:] = self._no_deadlines

    def timer_event(self, index: int, time: float) -> Event:
        return self._timer_events[index](TRANSFER_ID, time)

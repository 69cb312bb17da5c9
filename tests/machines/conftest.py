"""A small driver for one transfer of one machine, shared by the machine tests.

Every table checks all spec invariants and declarations after every step, so each test
also proves them along its path.
"""

from __future__ import annotations

import pytest

from moriio_fsm.machines import build_table
from moriio_fsm.runtime.declared import make_event


class Side:
    """Drives one transfer of one machine and keeps every effect it produced, in order."""

    def __init__(self, spec: str, tid: str = "tx-1", **config):
        self.table = build_table(spec, check_invariants=True, config=config or None)
        self.tid = tid
        self.now = 0.0
        self.effects: list = []
        self.results: list = []

    def send(self, kind: str, **data):
        self.now += 0.001
        source = data.pop("source", "")
        result = self.table.dispatch(make_event(kind, self.tid, self.now, data, source))
        self.effects.extend(result.effects)
        self.results.append(result)
        return result

    def advance(self, seconds: float):
        self.now += seconds
        fired = self.table.advance(self.now)
        for _, result in fired:
            self.effects.extend(result.effects)
        return fired

    def kinds(self, kind: str | None = None) -> list:
        if kind is None:
            return [e.kind for e in self.effects]
        return [e for e in self.effects if e.kind == kind]

    @property
    def state(self):
        return self.table.state_of(self.tid)

    @property
    def record(self):
        return self.table.get(self.tid)


@pytest.fixture
def side():
    return Side

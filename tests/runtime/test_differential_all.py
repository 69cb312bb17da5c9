"""Every shipped spec: the generated steps agree with pytransitions, with and without
check mode, on random event sequences built from the spec's own declarations.

Payloads are drawn from the declared field types, with ill-typed and out-of-range
values mixed in; timers advance at random; every invariant and declaration is checked
after every step, and every table's timers stay sound.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moriio_fsm.machines import MACHINE_MODULES, build_machine
from moriio_fsm.runtime.declared import make_event
from moriio_fsm.runtime.events import Event
from moriio_fsm.runtime.table import TransferTable

IDS = ("tx-a", "tx-b")
SMALL = {
    "write_producer": {
        "max_layers": 6,
        "transfer_timeout_s": 2.0,
        "defer_timeout_s": 5.0,
        "abandon_timeout_s": 1.0,
    },
    "write_consumer": {"max_writers": 4, "write_timeout_s": 3.0, "safety_timeout_s": 2.0},
    "read_producer": {"max_consumers": 4, "lease_s": 2.0, "max_hold_s": 6.0},
    "read_consumer": {
        "max_layers": 6,
        "setup_timeout_s": 3.0,
        "read_timeout_s": 1.0,
        "renew_interval_s": 0.5,
        "lease_margin_s": 0.5,
        "abandon_timeout_s": 0.3,
    },
    "watch_consumer": {"stuck_after_s": 1.0},
    "watch_producer": {"stranded_after_s": 1.0, "linger_s": 0.5},
    "watch_worker": {},
}
MACHINES = {name: build_machine(name, config=SMALL[name]) for name in MACHINE_MODULES}

VALUES = {
    "int": st.one_of(st.integers(-1, 6), st.just(2**70), st.sampled_from(["1", None, True])),
    "float": st.one_of(st.floats(0.0, 5.0), st.sampled_from([math.nan, math.inf, -1.0, "2"])),
    "str": st.sampled_from(["", "boom", None]),
    "bool": st.sampled_from([True, False, None]),
    "list": st.one_of(st.lists(st.integers(0, 9), max_size=3), st.sampled_from([None, "1,2"])),
    "tuple": st.one_of(st.tuples(st.integers(0, 5)), st.just(None)),
    "any": st.one_of(st.none(), st.integers(0, 3)),
}


def event_steps(spec):
    kinds = []
    for name, event in spec.events.items():
        fields = {field: VALUES[type_name] for field, type_name in event.payload.items()}
        kinds.append(st.tuples(st.just(name), st.fixed_dictionaries(fields)))
    kinds.append(st.tuples(st.just(""), st.just({})))  # a plain Event: no kind
    event = st.tuples(st.just("event"), st.sampled_from(IDS), st.one_of(kinds), st.floats(0.0, 0.5))
    advance = st.tuples(st.just("advance"), st.just(""), st.just(("", {})), st.floats(0.0, 3.0))
    return st.lists(st.one_of(event, advance), max_size=40)


def run(name: str, executor: str, checked: bool, steps) -> tuple[list, TransferTable]:
    table = TransferTable(
        MACHINES[name],
        executor=executor,
        check_invariants=checked,
        pending_capacity=16,
        ended_capacity=64,
    )
    now = 0.0
    trace = []
    for op, tid, (kind, data), dt in steps:
        now += dt
        if op == "advance":
            trace.extend((ev.transfer_id, ev.kind, ev.time, r) for ev, r in table.advance(now))
            continue
        ev = Event(tid, now) if not kind else make_event(kind, tid, now, data)
        trace.append((tid, kind, now, table.dispatch(ev)))
    return trace, table


@pytest.mark.parametrize("name", sorted(MACHINE_MODULES))
def test_generated_steps_agree_with_pytransitions_on_random_runs(name):
    @settings(
        max_examples=2000,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(event_steps(MACHINES[name].spec))
    def agree(steps):
        reference, reference_table = run(name, "transitions", True, steps)
        for checked in (True, False):
            trace, table = run(name, "compiled", checked, steps)
            assert trace == reference, (name, checked)
            assert table.stats() == reference_table.stats()
            assert table.audit() == []

    agree()

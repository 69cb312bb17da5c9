"""The ``moriio-fsm scenarios``: WRITE producer transfers driven through a driver.

Each scenario is a list of events (the time is part of each event, so runs are exact
and repeatable); a ``Driver`` dispatches them, fires due timers and carries out every
effect through handlers that only note what they were asked to do (the abandon handler
also answers, as an engine adapter would). It reports each transfer's path of
states with the effects every step emitted.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from .machines import build_table
from .runtime.declared import events
from .runtime.driver import Driver
from .runtime.events import Effect, Event

NUM_LAYERS = 4
BLOCKS = [7, 8, 9]


@dataclass
class Step:
    time: float
    event: str
    outcome: str
    state: str | None
    effects: list[str]
    hops: tuple = ()


@dataclass
class Scenario:
    name: str
    transfer_id: str
    description: str
    events: list[Event]
    advance_to: float = 0.0  # fire timers up to this time after the events
    adapter_answers: bool = True  # the engine adapter confirms torn-down writes
    steps: list[Step] = field(default_factory=list)

    @property
    def path(self) -> list[str]:
        """Every state the transfer passed through, transient ones included."""
        states: list[str] = []
        for step in self.steps:
            if step.outcome == "created" and not states:
                first = step.hops[0][0] if step.hops else step.state
                if first is not None:  # a created transfer always has a state
                    states.append(first)
            for _, to in step.hops:
                states.append(to)
        return states


def _describe(effect: Effect) -> str:
    data = {k: v for k, v in effect.data.items() if k != "block_ids"}
    args = ", ".join(f"{k}={v}" for k, v in data.items())
    return f"{effect.kind}({args})"


def _layers(tid: str, make, start: float) -> list[Event]:
    return [make(tid, start + i * 0.001, i) for i in range(NUM_LAYERS)]


# The openings the scenarios share; each plan below adds only what sets it apart.


def _allocated(t: str) -> list[Event]:
    """Prefill starts and D's allocation arrives at once."""
    return [events.prefill_started(t, 0.0, 1), events.remote_blocks(t, 0.01, BLOCKS, 0)]


def _all_sealed(t: str) -> list[Event]:
    """Every layer is scheduled, then the forward pass seals the transfer."""
    return [*_layers(t, events.layer_scheduled, 0.1), events.seal(t, 0.2)]


def _two_in_flight(t: str) -> list[Event]:
    """Only layers 0 and 1 are scheduled."""
    return [events.layer_scheduled(t, 0.1, 0), events.layer_scheduled(t, 0.101, 1)]


def _one_of_two_landed(t: str) -> list[Event]:
    """Allocated, two layers written and sealed, and only layer 0's write reports back."""
    return [
        *_allocated(t),
        *_two_in_flight(t),
        events.seal(t, 0.2),
        events.layer_write_completed(t, 0.3, 0),
    ]


@dataclass(frozen=True)
class _Plan:
    """One scenario as written: ``build`` makes its events for a transfer id."""

    name: str
    description: str
    build: Callable[[str], list[Event]]
    advance_to: float = 0.0
    adapter_answers: bool = True


# The event constructors are looked up when a scenario is built, not at import: asking
# ``events`` for a kind loads the shipped specs.
_PLANS: tuple[_Plan, ...] = (
    _Plan(
        "clean",
        "D's allocation first, every write lands, the request finishes",
        lambda t: [
            *_allocated(t),
            *_all_sealed(t),
            *_layers(t, events.layer_write_completed, 0.3),
            events.request_finished(t, 0.4),
        ],
    ),
    _Plan(
        "late_allocation",
        "layers scheduled and sealed before D's allocation arrives",
        lambda t: [
            events.prefill_started(t, 0.0, 1),
            *_all_sealed(t),
            events.request_finished(t, 0.25),
            events.remote_blocks(t, 0.5, BLOCKS, 0),
            events.remote_blocks(t, 0.51, BLOCKS, 0),
            *_layers(t, events.layer_write_completed, 0.6),
        ],
    ),
    _Plan(
        "failed_write",
        "one layer's RDMA write fails; D is told; in-flight writes drain",
        lambda t: [
            *_allocated(t),
            *_all_sealed(t),
            events.layer_write_completed(t, 0.3, 0),
            events.layer_write_failed(t, 0.31, 1, 13),
            events.layer_write_completed(t, 0.32, 2),
            events.layer_write_completed(t, 0.33, 3),
            events.request_finished(t, 0.4),
        ],
    ),
    _Plan(
        "aborted",
        "the local request is aborted mid-forward with writes in flight",
        lambda t: [
            *_allocated(t),
            *_two_in_flight(t),
            events.abort(t, 0.15),
            events.layer_write_completed(t, 0.2, 0),
            events.layer_write_completed(t, 0.21, 1),
        ],
    ),
    _Plan(
        "defer_timeout",
        "D's allocation never arrives: the defer timer expires the transfer",
        lambda t: [
            events.prefill_started(t, 0.0, 1),
            *_all_sealed(t),
            events.request_finished(t, 0.3),
        ],
        advance_to=61.0,
    ),
    _Plan(
        "stalled_write",
        "a write never reports back: it is torn down, then D is told",
        lambda t: [*_one_of_two_landed(t), events.request_finished(t, 0.4)],
        advance_to=31.0,
    ),
    _Plan(
        "unconfirmed_teardown",
        "the engine never confirms the torn-down write: quarantined",
        lambda t: [*_one_of_two_landed(t), events.abort(t, 0.35)],
        advance_to=45.0,
        adapter_answers=False,
    ),
)


def scenarios() -> list[Scenario]:
    """The transfers, one per lifecycle path worth seeing, each new (no steps yet)."""
    made = []
    for plan in _PLANS:
        tid = f"tx-demo-{plan.name}"
        made.append(
            Scenario(
                plan.name,
                tid,
                plan.description,
                plan.build(tid),
                plan.advance_to,
                plan.adapter_answers,
            )
        )
    return made


def _driver(scenario: Scenario, make_table: Callable) -> Driver:
    table = make_table()

    def note(effect: Effect) -> None:
        return None

    def abandon(effect: Effect):
        # A real adapter tears the sessions down; these answer at once, or never.
        if scenario.adapter_answers:
            return events.writes_abandoned(effect.transfer_id, scenario.advance_to)
        return None

    handlers = {kind: note for kind in table.spec.emits}
    handlers["abandon_writes"] = abandon
    return Driver(table, handlers, clock=lambda: scenario.advance_to)


def run(make_table: Callable | None = None, recorder=None) -> list[Scenario]:
    """Drive every scenario through a table of its own (each starts its clock at 0),
    checking every spec invariant after every step; ``recorder`` (a ``TraceRecorder``)
    traces every table."""
    make_table = make_table or (
        lambda: build_table("write_producer", check_invariants=True, recorder=recorder)
    )
    done = scenarios()
    for scenario in done:
        driver = _driver(scenario, make_table)
        for ev in scenario.events:
            _record(scenario, driver.advance(ev.time))
            _record(scenario, driver.dispatch(ev))
        _record(scenario, driver.advance(scenario.advance_to))
    return done


def _record(scenario: Scenario, steps) -> None:
    for ev, result in steps:
        scenario.steps.append(
            Step(
                ev.time,
                ev.kind,
                result.outcome.value,
                result.state,
                [_describe(e) for e in result.effects],
                result.hops or (),
            )
        )


def render(done: list[Scenario]) -> str:
    lines = []
    for scenario in done:
        lines.append(f"== {scenario.name}: {scenario.description}")
        lines.append(f"   transfer {scenario.transfer_id}")
        for step in scenario.steps:
            effects = ("  -> " + "; ".join(step.effects)) if step.effects else ""
            lines.append(
                f"   t={step.time:7.3f}s {step.event:<22} {step.outcome:<9} "
                f"{step.state or '-':<12}{effects}"
            )
        lines.append("   path: " + " -> ".join(scenario.path))
        lines.append("")
    return "\n".join(lines)

"""The ``moriio-fsm demo`` scenarios: WRITE producer transfers driven through the runtime.

Each scenario is a list of events (the time is part of each event, so runs are
exact and repeatable); the demo dispatches them, fires due timers, and reports each
transfer's path of states with the effects every step emitted.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from .machines import build_table
from .runtime.events import Event
from .runtime.table import TransferTable

NUM_LAYERS = 4


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
    advance_to: float = 0.0          # fire timers up to this time after the events
    steps: list[Step] = field(default_factory=list)

    @property
    def path(self) -> list[str]:
        """Every state the transfer passed through, transient ones included."""
        states: list[str] = []
        for step in self.steps:
            if step.outcome == "created" and not states:
                states.append(step.state if not step.hops else step.hops[0][0])
            for _, to in step.hops:
                states.append(to)
        return states


def _describe(effect) -> str:
    data = dict(effect.data)
    data.pop("block_ids", None)
    args = ", ".join(f"{k}={v}" for k, v in data.items())
    return f"{effect.kind}({args})"


def _layers(tid: str, kind: str, start: float) -> list[Event]:
    return [Event(tid, kind, start + i * 0.001, {"layer": i}) for i in range(NUM_LAYERS)]


def scenarios() -> list[Scenario]:
    """The demo's five transfers, one per lifecycle path worth seeing."""
    blocks = {"block_ids": [7, 8, 9], "decode_rank": 0}
    created = {"num_writers": 1}

    def make(name: str, description: str, build: Callable[[str], list[Event]],
             advance_to: float = 0.0) -> Scenario:
        tid = f"tx-demo-{name}"
        return Scenario(name, tid, description, build(tid), advance_to)

    return [
        make("clean", "D's allocation first, every write lands, the request finishes",
             lambda t: [Event(t, "create", 0.0, created), Event(t, "remote_blocks", 0.01, blocks),
                        *_layers(t, "layer_scheduled", 0.1), Event(t, "seal", 0.2),
                        *_layers(t, "write_completed", 0.3), Event(t, "request_finished", 0.4)]),
        make("late_allocation", "layers scheduled and sealed before D's allocation arrives",
             lambda t: [Event(t, "create", 0.0, created), *_layers(t, "layer_scheduled", 0.1),
                        Event(t, "seal", 0.2), Event(t, "request_finished", 0.25),
                        Event(t, "remote_blocks", 0.5, blocks),
                        Event(t, "remote_blocks", 0.51, blocks),
                        *_layers(t, "write_completed", 0.6)]),
        make("failed_write", "one layer's RDMA write fails; D is told; in-flight writes drain",
             lambda t: [Event(t, "create", 0.0, created), Event(t, "remote_blocks", 0.01, blocks),
                        *_layers(t, "layer_scheduled", 0.1), Event(t, "seal", 0.2),
                        Event(t, "write_completed", 0.3, {"layer": 0}),
                        Event(t, "write_failed", 0.31, {"layer": 1, "code": 13}),
                        Event(t, "write_completed", 0.32, {"layer": 2}),
                        Event(t, "write_completed", 0.33, {"layer": 3}),
                        Event(t, "request_finished", 0.4)]),
        make("aborted", "the local request is aborted mid-forward with writes in flight",
             lambda t: [Event(t, "create", 0.0, created), Event(t, "remote_blocks", 0.01, blocks),
                        Event(t, "layer_scheduled", 0.1, {"layer": 0}),
                        Event(t, "layer_scheduled", 0.101, {"layer": 1}),
                        Event(t, "abort", 0.15), Event(t, "write_completed", 0.2, {"layer": 0}),
                        Event(t, "write_completed", 0.21, {"layer": 1})]),
        make("defer_timeout", "D's allocation never arrives: the defer timer expires the transfer",
             lambda t: [Event(t, "create", 0.0, created), *_layers(t, "layer_scheduled", 0.1),
                        Event(t, "seal", 0.2), Event(t, "request_finished", 0.3)],
             advance_to=61.0),
    ]


def run(make_table: Callable[[], TransferTable] | None = None) -> list[Scenario]:
    """Drive every scenario through a table of its own (each starts its clock at 0),
    checking every spec invariant after every step."""
    make_table = make_table or (lambda: build_table("write_producer", check_invariants=True))
    done = scenarios()
    for scenario in done:
        table = make_table()
        for ev in scenario.events:
            for timer_ev, timer_result in table.advance(ev.time):
                _record(scenario, timer_ev, timer_result)
            _record(scenario, ev, table.dispatch(ev))
        for timer_ev, timer_result in table.advance(scenario.advance_to):
            _record(scenario, timer_ev, timer_result)
    return done


def _record(scenario: Scenario, ev: Event, result) -> None:
    scenario.steps.append(Step(ev.time, ev.kind, result.outcome.value, result.state,
                               [_describe(e) for e in result.effects], result.hops or ()))


def render(done: list[Scenario]) -> str:
    lines = []
    for scenario in done:
        lines.append(f"== {scenario.name}: {scenario.description}")
        lines.append(f"   transfer {scenario.transfer_id}")
        for step in scenario.steps:
            effects = ("  -> " + "; ".join(step.effects)) if step.effects else ""
            lines.append(f"   t={step.time:7.3f}s {step.event:<17} {step.outcome:<9} "
                         f"{step.state or '-':<11}{effects}")
        lines.append("   path: " + " -> ".join(scenario.path))
        lines.append("")
    return "\n".join(lines)

"""The sections that move a machine: transition rows and timers.

Rules: read after every other section, so each state, event, guard, action, emit and
config key a row or timer names is checked against its declaration; a reader records each
problem on the ``SpecReader`` with its line and never raises.
"""

from __future__ import annotations

from .model import TRANSITION_OUTCOMES, TimerSpec, TransitionSpec
from .spec_reader import SpecReader, listing
from .yaml_lines import kind_of, line_of, show

TRANSITION_KEYS = {"event", "source", "dest", "internal", "guard", "actions", "emits", "outcome"}


def read_transitions(
    r: SpecReader, raw: dict, states: dict, events: dict, guards: dict, actions: dict, emits: dict
) -> list[TransitionSpec]:
    raw_transitions = raw.get("transitions")
    if raw_transitions is None:
        r.problem(line_of(raw, "transitions", 1), "missing 'transitions' (expected a list)")
        return []
    if not isinstance(raw_transitions, list):
        r.problem(
            line_of(raw, "transitions", 1),
            f"'transitions' must be a list, got {kind_of(raw_transitions)}",
        )
        return []
    transitions: list[TransitionSpec] = []
    for index, entry in enumerate(raw_transitions):
        line = line_of(raw_transitions, index, 1)
        if not isinstance(entry, dict):
            r.problem(line, f"transition #{index} must be a mapping")
            continue
        row = _Row(r, entry, index, line)
        row.check_keys()
        event = row.event(events)
        sources = row.sources(states)
        internal, dest = row.dest(states)
        guard = row.guard(guards)
        action_names = row.names("actions", actions, "actions")
        emit_names = row.names("emits", emits, "emits")
        outcome = row.outcome(internal, action_names, emit_names)
        transitions.append(
            TransitionSpec(
                index,
                event,
                sources,
                dest if not internal else None,
                guard,
                action_names,
                emit_names,
                outcome,
                line,
            )
        )
    return transitions


class _Row:
    """The readers of one transition row (``transition #index`` in every message)."""

    def __init__(self, r: SpecReader, entry: dict, index: int, line: int):
        self.r, self.entry, self.index, self.line = r, entry, index, line
        self.label = f"transition #{index}"

    def check_keys(self) -> None:
        for key in self.entry:
            if key == "effects":
                self.r.problem(
                    line_of(self.entry, key, self.line),
                    f"{self.label}: 'effects' is split into 'actions' (context "
                    "updates) and 'emits' (effect kinds)",
                )
            elif key not in TRANSITION_KEYS:
                self.r.problem(
                    line_of(self.entry, key, self.line),
                    f"{self.label}: unknown key {key!r}; expected "
                    f"{', '.join(sorted(TRANSITION_KEYS))}",
                )

    def event(self, events: dict) -> str | None:
        event_line = line_of(self.entry, "event", self.line)
        event = self.r.name(self.entry.get("event"), event_line, f"{self.label} event")
        if event is not None:
            self.r.known(event, events, event_line, "event", self.label)
        return event

    def sources(self, states: dict) -> tuple[str, ...]:
        raw_sources = self.entry.get("source")
        source_line = line_of(self.entry, "source", self.line)
        sources = self.r.names(raw_sources, source_line, f"{self.label} source")
        for i, s in enumerate(sources):
            self.r.known(
                s, states, line_of(raw_sources, i, source_line), "state", f"{self.label} source"
            )
        if len(set(sources)) != len(sources):
            self.r.problem(source_line, f"{self.label} lists a state twice in source")
        return sources

    def dest(self, states: dict) -> tuple[bool, str | None]:
        r, entry, label, line = self.r, self.entry, self.label, self.line
        internal = r.flag(entry, "internal", line, label)
        dest_line = line_of(entry, "dest", line)
        dest = r.name(entry.get("dest"), dest_line, f"{label} dest")
        if internal and dest is not None:
            r.problem(line, f"{label} is internal and also names dest {dest!r}; choose one")
        if not internal and dest is None and entry.get("dest") is None:
            r.problem(line, f"{label} needs a 'dest' state or 'internal: true'")
        if dest is not None:
            r.known(dest, states, dest_line, "state", f"{label} dest")
        if entry.get("event") is None and internal:
            r.problem(
                line,
                f"{label} is eventless and internal; an eventless "
                "transition must change state or it would fire forever",
            )
        return internal, dest

    def guard(self, guards: dict) -> str | None:
        guard_line = line_of(self.entry, "guard", self.line)
        guard = self.r.name(self.entry.get("guard"), guard_line, f"{self.label} guard")
        if guard is not None and guard not in guards:
            self.r.problem(
                guard_line, f"unknown guard {guard!r} in {self.label}; declare it under 'guards'"
            )
        return guard

    def names(self, key: str, declared: dict, section: str) -> tuple[str, ...]:
        raw_list = self.entry.get(key)
        list_line = line_of(self.entry, key, self.line)
        names = (
            self.r.names(raw_list, list_line, f"{self.label} {key}")
            if raw_list not in (None, [])
            else ()
        )
        for i, n in enumerate(names):
            if n not in declared:
                self.r.problem(
                    line_of(raw_list, i, list_line),
                    f"unknown {key[:-1]} {n!r} in {self.label}; declare it under '{section}'",
                )
        if len(set(names)) != len(names):
            self.r.problem(list_line, f"{self.label} lists a {key[:-1]} twice in {key}")
        return names

    def outcome(self, internal: bool, action_names: tuple, emit_names: tuple) -> str:
        r, entry, label, line = self.r, self.entry, self.label, self.line
        outcome = entry.get("outcome", "applied")
        if outcome not in TRANSITION_OUTCOMES:
            r.problem(
                line_of(entry, "outcome", line),
                f"{label}: outcome must be one of "
                f"{', '.join(TRANSITION_OUTCOMES)}, got "
                f"{show(outcome)}",
            )
        if outcome != "applied" and (action_names or emit_names or not internal):
            r.problem(
                line,
                f"{label} declares outcome {show(outcome)}, which is only for "
                "internal transitions without actions or emits",
            )
        if emit_names and not action_names:
            r.problem(
                line_of(entry, "emits", line),
                f"{label} lists emits but no action: effects are emitted by actions",
            )
        return outcome


def read_timers(
    r: SpecReader, raw: dict, states: dict, events: dict, config: dict
) -> dict[str, TimerSpec]:
    timers: dict[str, TimerSpec] = {}
    for key, entry, line in r.entries(raw, "timers", "timer"):
        if not isinstance(entry, dict):
            r.problem(line, f"timer {key!r} must be a mapping with states, duration and event")
            continue
        where = f"timer {key!r}"
        states_line = line_of(entry, "states", line)
        t_states = r.names(entry.get("states"), states_line, f"{where} states")
        for i, s in enumerate(t_states):
            r.known(s, states, line_of(entry.get("states"), i, states_line), "state", where)
        duration = entry.get("duration")
        if not isinstance(duration, str) or duration not in config:
            r.problem(
                line_of(entry, "duration", line),
                f"{where}: duration must name a config "
                f"key, got {show(duration)}; known: "
                f"{listing(config)}",
            )
        event = read_timer_event(r, where, entry, line, events)
        raw_restart = entry.get("restart_on")
        restart_line = line_of(entry, "restart_on", line)
        restart = (
            r.names(raw_restart, restart_line, f"{where} restart_on")
            if raw_restart not in (None, [])
            else ()
        )
        for i, e in enumerate(restart):
            r.known(
                e, events, line_of(raw_restart, i, restart_line), "event", f"{where} restart_on"
            )
        timers[key] = TimerSpec(key, t_states, str(duration), event, tuple(restart), line)
    return timers


def read_timer_event(r: SpecReader, where: str, entry: dict, line: int, events: dict) -> str:
    event = entry.get("event")
    event_line = line_of(entry, "event", line)
    if not isinstance(event, str):
        r.problem(event_line, f"{where} needs the 'event' it fires, as a name; got {show(event)}")
        return ""
    r.known(event, events, event_line, "event", where)
    if event in events and events[event].origin != "timer":
        r.problem(event_line, f"{where} fires event {event!r}, whose origin must be 'timer'")
    return event

"""One reader per section of a spec: the raw YAML of each section into model objects.

Rules: ``read_spec`` reads the sections in one fixed order (a section may refer only to
those read before it, so a name is checked against its declaration), records every
problem with its line and raises one ``SpecError`` listing them all. Each reader gets
the ``SpecReader`` that collects the problems; none raises on bad input.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

from .errors import SpecError
from .model import (
    CONTEXT_TYPES,
    EVENT_FIELDS,
    EVENT_ORIGINS,
    FIELD_TYPES,
    TRANSITION_OUTCOMES,
    ActionSpec,
    ConfigKey,
    ConfigRef,
    ContextField,
    EmitSpec,
    EventSpec,
    GuardSpec,
    InvariantSpec,
    Spec,
    StateSpec,
    TimerSpec,
    TransitionSpec,
)
from .spec_reader import (
    MAX_INT,
    RESERVED_PREFIX,
    SpecReader,
    listing,
    out_of_range,
    reserved_message,
)
from .yaml_lines import LineDict, kind_of, line_of, show

TOP_LEVEL = {
    "name",
    "summary",
    "initial",
    "config",
    "context",
    "states",
    "events",
    "guards",
    "actions",
    "emits",
    "timers",
    "transitions",
    "invariants",
}
CONFIG_KEYS = ("default", "doc", "exceeds")
TRANSITION_KEYS = {"event", "source", "dest", "internal", "guard", "actions", "emits", "outcome"}


def read_spec(r: SpecReader, raw: dict, path: str) -> Spec:
    """The ``Spec`` of the top-level mapping ``raw``; ``SpecError`` with every problem
    ``r`` holds once all sections are read."""
    read_top_level_keys(r, raw)
    name = raw.get("name")
    if not isinstance(name, str) or not name:
        r.problem(line_of(raw, "name", 1), "missing or empty 'name' (expected the machine's name)")
        name = "<unnamed>"
    summary = r.text(raw.get("summary"), line_of(raw, "summary", 1), "summary")
    config = read_config(r, raw)
    context = read_context(r, raw, config)
    states = read_states(r, raw)
    events = read_events(r, raw)
    guards = read_guards(r, raw, set(context) | set(config))
    actions = read_actions(r, raw, context)
    emits = read_emits(r, raw, events)
    initial = read_initial(r, raw, states)
    transitions = read_transitions(r, raw, states, events, guards, actions, emits)
    timers = read_timers(r, raw, states, events, config)
    invariants = read_invariants(r, raw)
    if r.problems:
        raise SpecError(r.problems)
    return Spec(
        name=name,
        summary=summary,
        path=path,
        initial=initial,
        config=config,
        context=context,
        states=states,
        events=events,
        guards=guards,
        actions=actions,
        emits=emits,
        transitions=tuple(transitions),
        timers=timers,
        invariants=tuple(invariants),
    )


def read_top_level_keys(r: SpecReader, raw: dict) -> None:
    for key in raw:
        if key == "effects":
            r.problem(
                line_of(raw, key, 1),
                "'effects' is not a section: updates of the context "
                "are 'actions' (with the fields each 'writes') and "
                "what the outside world must do are 'emits' (with "
                "their 'fields')",
            )
        elif key not in TOP_LEVEL:
            r.problem(
                line_of(raw, key, 1),
                f"unknown top-level key {key!r}; expected one of {', '.join(sorted(TOP_LEVEL))}",
            )


def read_config(r: SpecReader, raw: dict) -> dict[str, ConfigKey]:
    config: dict[str, ConfigKey] = {}
    for key, entry, line in r.entries(raw, "config", "config key", attribute=True):
        # A key with a bad default is still declared, so that a timer naming it is not
        # reported too (the spec is refused either way).
        if not isinstance(entry, dict) or "default" not in entry:
            r.problem(line, f"config key {key!r} must be a mapping with a 'default'")
            config[key] = ConfigKey(key, None, "", line)
            continue
        default = entry["default"]
        if (
            isinstance(default, bool)
            or not isinstance(default, (int, float))
            or not 0 < default < MAX_INT
        ):
            r.problem(
                line,
                f"config key {key!r}: default must be a positive finite number "
                f"below 2**63 (a duration or a limit), got {show(default)}",
            )
        r.unknown_keys(entry, CONFIG_KEYS, line, f"config key {key!r}", ", ".join(CONFIG_KEYS))
        config[key] = ConfigKey(
            key,
            default,
            r.text(entry.get("doc"), line, "doc"),
            line,
            read_exceeds(r, key, entry, line),
        )
    return config


def read_exceeds(r: SpecReader, key: str, entry: dict, line: int) -> tuple[ConfigRef, ...]:
    """The bound of config key ``key``: a list of ``machine.key`` names. Whether each
    names a known machine and key is the loader's check across specs (``bounds.py``)."""
    if "exceeds" not in entry:
        return ()
    raw = entry["exceeds"]
    where = f"config key {key!r}: exceeds"
    exceeds_line = line_of(entry, "exceeds", line)
    if not isinstance(raw, list) or not raw:
        r.problem(
            exceeds_line,
            f"{where} must be a non-empty list of MACHINE.KEY names (the "
            f"keys whose sum this key must exceed), got {show(raw)}",
        )
        return ()
    refs: list[ConfigRef] = []
    for i, item in enumerate(raw):
        item_line = line_of(raw, i, exceeds_line)
        machine, dot, name = item.partition(".") if isinstance(item, str) else ("", "", "")
        if not (dot and machine.isidentifier() and name.isidentifier()):
            r.problem(
                item_line,
                f"{where}: {show(item)} is not MACHINE.KEY (a machine's name, "
                "a dot and one of its config keys)",
            )
        elif any((ref.machine, ref.key) == (machine, name) for ref in refs):
            r.problem(item_line, f"{where} names {item!r} twice")
        else:
            refs.append(ConfigRef(machine, name, item_line))
    return tuple(refs)


def read_context(r: SpecReader, raw: dict, config: dict) -> dict[str, ContextField]:
    context: dict[str, ContextField] = {}
    for key, entry, line in r.entries(raw, "context", "context field", attribute=True):
        if key in config:
            r.problem(
                line, f"context field {key!r} has the name of a config key; names must differ"
            )
            continue
        ftype = entry.get("type") if isinstance(entry, dict) else None
        if not isinstance(ftype, str) or ftype not in CONTEXT_TYPES:
            r.problem(
                line,
                f"context field {key!r} needs a type, one of {', '.join(CONTEXT_TYPES)}; "
                f"got {show(ftype)}",
            )
            continue
        initial = entry.get("initial")
        if initial is None and ftype != "object":
            r.problem(line, f"context field {key!r} of type {ftype} needs an 'initial' value")
        elif (
            initial is not None
            and not isinstance(initial, CONTEXT_TYPES[ftype])
            or (ftype in ("int", "bitmap", "float") and isinstance(initial, bool))
        ):
            r.problem(
                line, f"context field {key!r}: initial value {show(initial)} is not of type {ftype}"
            )
        elif ftype != "object" and out_of_range(initial):
            r.problem(
                line,
                f"context field {key!r}: initial value {show(initial)} is out of "
                "range; numbers must be finite, above -2**63 and below 2**63",
            )
        context[key] = ContextField(
            key, ftype, initial, r.text(entry.get("doc"), line, "doc"), line
        )
    return context


def read_states(r: SpecReader, raw: dict) -> dict[str, StateSpec]:
    states: dict[str, StateSpec] = {}
    for key, entry, line in r.entries(raw, "states", "state", required=True):
        entry = entry if isinstance(entry, dict) else {}
        r.unknown_keys(
            entry, ("doc", "final", "anomaly"), line, f"state {key!r}", "doc, final, anomaly"
        )
        final = r.flag(entry, "final", line, f"state {key!r}")
        anomaly = r.flag(entry, "anomaly", line, f"state {key!r}")
        if anomaly and not final:
            r.problem(
                line_of(entry, "anomaly", line),
                f"state {key!r} is marked anomaly but is "
                "not final; only a final state can be an anomaly",
            )
        states[key] = StateSpec(key, r.text(entry.get("doc"), line, "doc"), final, line, anomaly)
    return states


def read_events(r: SpecReader, raw: dict) -> dict[str, EventSpec]:
    events: dict[str, EventSpec] = {}
    for key, entry, line in r.entries(raw, "events", "event", required=True):
        entry = entry if isinstance(entry, dict) else {}
        origin = entry.get("origin")
        if origin not in EVENT_ORIGINS:
            r.problem(
                line,
                f"event {key!r}: origin must be one of {', '.join(EVENT_ORIGINS)}, "
                f"got {show(origin)}",
            )
            origin = "local"
        raw_payload = entry.get("payload") or {}
        if not isinstance(raw_payload, dict):
            r.problem(line, f"event {key!r}: payload must map field names to types")
            raw_payload = {}
        payload, defaults = read_payload(r, key, raw_payload, line)
        creates = r.flag(entry, "creates", line, f"event {key!r}")
        if creates and origin != "local":
            r.problem(
                line,
                f"event {key!r} creates transfers but its origin is {origin!r}; "
                "only local events may create a transfer (a peer's message never does)",
            )
        events[key] = EventSpec(
            key, origin, r.text(entry.get("doc"), line, "doc"), payload, creates, line, defaults
        )
    return events


def read_payload(
    r: SpecReader, event: str, raw_payload: dict, line: int
) -> tuple[dict[str, str], dict[str, Any]]:
    """An event's payload fields (name -> type) and their defaults. A default that does
    not fit is kept in ``defaults`` (its field is refused), as the model records it."""
    payload: dict[str, str] = {}
    defaults: dict[str, Any] = {}
    for field_name, declared in raw_payload.items():
        field_line = line_of(raw_payload, field_name, line)
        where = f"event {event!r}: payload field"
        if isinstance(field_name, str) and field_name.startswith(RESERVED_PREFIX):
            r.problem(
                field_line, f"event {event!r}: " + reserved_message("payload field", field_name)
            )
            continue
        if (
            not isinstance(field_name, str)
            or not field_name.isidentifier()
            or field_name in EVENT_FIELDS
            or field_name.startswith("_")
        ):
            r.problem(
                field_line,
                f"{where} name {show(field_name)} must be an identifier other "
                "than " + ", ".join(sorted(EVENT_FIELDS)) + " (and not starting with '_')",
            )
            continue
        type_name = declared
        if isinstance(declared, dict):
            type_name = declared.get("type")
            if "default" in declared:
                defaults[field_name] = declared["default"]
            extra = set(declared) - {"type", "default"}
            if extra:
                r.problem(
                    field_line,
                    f"{where} {field_name!r}: unknown key(s) "
                    f"{', '.join(sorted(map(str, extra)))}; expected type and default",
                )
        if not isinstance(type_name, str) or type_name not in FIELD_TYPES:
            r.problem(
                field_line,
                f"{where} {field_name!r} has unknown type {show(type_name)}; "
                f"expected one of {', '.join(FIELD_TYPES)}",
            )
            continue
        if field_name in defaults and not _default_fits(defaults[field_name], type_name):
            r.problem(
                field_line,
                f"{where} {field_name!r}: default "
                f"{show(defaults[field_name])} is not of type {type_name}",
            )
            continue
        if (
            field_name in defaults
            and type_name in ("int", "float")
            and out_of_range(defaults[field_name])
        ):
            r.problem(
                field_line,
                f"{where} {field_name!r}: default "
                f"{show(defaults[field_name])} is out of range; numbers must "
                "be finite, above -2**63 and below 2**63",
            )
            continue
        if defaults and field_name not in defaults:
            r.problem(
                field_line,
                f"{where} {field_name!r} has no default but comes after one "
                "that has; list required fields first",
            )
            continue
        payload[field_name] = type_name
    return payload, defaults


def _default_fits(value: Any, type_name: str) -> bool:
    return isinstance(value, FIELD_TYPES[type_name]) and not (
        isinstance(value, bool) and type_name in ("int", "float")
    )


def read_declared(r: SpecReader, raw: dict, section: str, list_key: str, what: str):
    """Entries of ``section`` (guards, actions): ``name: doc`` or a mapping with ``doc``
    and ``list_key`` (field names). Yields ``(name, doc, names, entry, line)``."""
    allowed = {"doc", list_key}
    for key, entry, line in r.entries(raw, section, what):
        if entry is None or isinstance(entry, str):
            yield key, r.text(entry, line, f"{what} {key!r} doc"), (), LineDict(), line
            continue
        if not isinstance(entry, dict):
            r.problem(
                line,
                f"{what} {key!r} must be a doc string or a mapping with doc and "
                f"{list_key}, got {kind_of(entry)}",
            )
            continue
        r.unknown_keys(entry, allowed, line, f"{what} {key!r}", ", ".join(sorted(allowed)))
        names: tuple[str, ...] = ()
        if list_key in entry and entry[list_key] not in (None, []):
            names = r.names(
                entry[list_key], line_of(entry, list_key, line), f"{what} {key!r} {list_key}"
            )
        yield key, r.text(entry.get("doc"), line, f"{what} {key!r} doc"), names, entry, line


def read_guards(r: SpecReader, raw: dict, fields_known: set[str]) -> dict[str, GuardSpec]:
    guards: dict[str, GuardSpec] = {}
    for key, doc, reads, entry, line in read_declared(r, raw, "guards", "reads", "guard"):
        for field_name in reads:
            if field_name not in fields_known:
                r.problem(
                    line_of(entry, "reads", line),
                    f"guard {key!r} reads {field_name!r}, "
                    "which is neither a context field nor a "
                    "config key",
                )
        guards[key] = GuardSpec(key, doc, reads, line)
    return guards


def read_actions(r: SpecReader, raw: dict, context: dict) -> dict[str, ActionSpec]:
    actions: dict[str, ActionSpec] = {}
    for key, doc, writes, entry, line in read_declared(r, raw, "actions", "writes", "action"):
        for field_name in writes:
            if field_name not in context:
                r.problem(
                    line_of(entry, "writes", line),
                    f"action {key!r} writes {field_name!r}, which is not a context field",
                )
        actions[key] = ActionSpec(key, doc, writes, line)
    return actions


def read_emits(r: SpecReader, raw: dict, events: dict) -> dict[str, EmitSpec]:
    emits: dict[str, EmitSpec] = {}
    for key, entry, line in r.entries(raw, "emits", "emit"):
        if not isinstance(entry, dict):
            r.problem(line, f"emit {key!r} must be a mapping with doc, fields and on_failure")
            continue
        r.unknown_keys(
            entry, ("doc", "fields", "on_failure"), line, f"emit {key!r}", "doc, fields, on_failure"
        )
        fields = read_emit_fields(r, key, entry, line)
        on_failure = r.name(
            entry.get("on_failure"), line_of(entry, "on_failure", line), f"emit {key!r} on_failure"
        )
        if on_failure is not None and on_failure not in events:
            r.problem(
                line_of(entry, "on_failure", line),
                f"emit {key!r}: on_failure names unknown event {on_failure!r}",
            )
        emits[key] = EmitSpec(
            key,
            r.text(entry.get("doc"), line, f"emit {key!r} doc"),
            {k: str(v) for k, v in fields.items()},
            on_failure,
            line,
        )
    return emits


def read_emit_fields(r: SpecReader, emit: str, entry: dict, line: int) -> dict:
    fields = entry.get("fields") or {}
    if not isinstance(fields, dict) or not all(
        isinstance(k, str) and k.isidentifier() for k in fields
    ):
        r.problem(
            line_of(entry, "fields", line),
            f"emit {emit!r}: fields must map field names to type names",
        )
        fields = {}
    for field_name in [f for f in fields if f.startswith(RESERVED_PREFIX)]:
        r.problem(
            line_of(fields, field_name, line),
            f"emit {emit!r}: " + reserved_message("emit field", field_name),
        )
        del fields[field_name]
    for field_name, type_name in fields.items():
        if not isinstance(type_name, Hashable) or type_name not in FIELD_TYPES:
            r.problem(
                line_of(fields, field_name, line),
                f"emit {emit!r}: field {field_name!r} has unknown type {show(type_name)}; "
                f"expected one of {', '.join(FIELD_TYPES)}",
            )
    return fields


def read_initial(r: SpecReader, raw: dict, states: dict) -> str:
    initial = raw.get("initial")
    initial_line = line_of(raw, "initial", 1)
    if not isinstance(initial, str):
        r.problem(initial_line, "missing 'initial' (expected the name of the initial state)")
        return ""
    if initial not in states:
        r.problem(
            initial_line,
            f"unknown state {initial!r} given as initial; known states: {listing(states)}",
        )
    return initial


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


def read_invariants(r: SpecReader, raw: dict) -> list[InvariantSpec]:
    invariants: list[InvariantSpec] = []
    for key, expr, line in r.entries(raw, "invariants", "invariant"):
        if not isinstance(expr, str):
            r.problem(line, f"invariant {key!r} must be an expression string")
            continue
        invariants.append(InvariantSpec(key, expr, line))
    return invariants

"""Load a spec from YAML into ``moriio_fsm.lang.model.Spec`` with precise errors.

The loader keeps the line of every mapping key and list item, so each problem it
or the validator reports points at ``file:line``. It collects all problems of a
file and raises one ``SpecError`` listing them, rather than stopping at the first.
"""

from __future__ import annotations

from collections.abc import Hashable
from pathlib import Path
from typing import Any

import yaml

from .errors import Problem, SpecError
from .expr import FUNCTIONS
from .model import (CONTEXT_TYPES, EVENT_ORIGINS, PAYLOAD_TYPES, RESERVED_NAMES,
                    TRANSITION_OUTCOMES, ConfigKey, ContextField,
                    EventSpec, InvariantSpec, Spec, StateSpec, TimerSpec, TransitionSpec)


class _LineDict(dict):
    line: int = 0
    key_lines: dict[str, int]


class _LineList(list):
    line: int = 0
    item_lines: list[int]


class _LineLoader(yaml.SafeLoader):
    """SafeLoader that records 1-based lines and refuses duplicate keys."""

    duplicate_keys: list[tuple[int, str]]

    def construct_mapping(self, node, deep=False):  # type: ignore[override]
        result = _LineDict()
        result.line = node.start_mark.line + 1
        result.key_lines = {}
        for key_node, value_node in node.value:
            key = self.construct_object(key_node, deep=True)
            if not isinstance(key, Hashable):
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping", node.start_mark,
                    "found a key that is a list or mapping; keys must be names", key_node.start_mark)
            if key in result:
                self.duplicate_keys.append((key_node.start_mark.line + 1, str(key)))
            result[key] = self.construct_object(value_node, deep=True)
            result.key_lines[key] = key_node.start_mark.line + 1
        return result

    def construct_sequence(self, node, deep=False):  # type: ignore[override]
        result = _LineList(self.construct_object(child, deep=True) for child in node.value)
        result.line = node.start_mark.line + 1
        result.item_lines = [child.start_mark.line + 1 for child in node.value]
        return result


_LineLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG,
                            _LineLoader.construct_mapping)
_LineLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_SEQUENCE_TAG,
                            _LineLoader.construct_sequence)


def _kind(value: Any) -> str:
    """The YAML word for a value's type, for messages ("mapping", "list", "str")."""
    if isinstance(value, dict):
        return "mapping"
    if isinstance(value, list):
        return "list"
    return type(value).__name__


def _line_of(container: Any, key: Any, default: int) -> int:
    """The line of ``container[key]``, or ``default`` (the owner's line) when it is absent."""
    if isinstance(container, _LineDict):
        return container.key_lines.get(key, default)
    if isinstance(container, _LineList) and isinstance(key, int) and key < len(container.item_lines):
        return container.item_lines[key]
    return default


class _Reader:
    """Turns the raw YAML tree into model objects, collecting problems on the way."""

    def __init__(self, path: str):
        self.path = path
        self.problems: list[Problem] = []

    def problem(self, line: int, message: str) -> None:
        self.problems.append(Problem(self.path, line, message))

    def mapping(self, parent: Any, key: str, line: int, required: bool = True) -> _LineDict:
        value = parent.get(key) if isinstance(parent, dict) else None
        if value is None:
            if required:
                self.problem(line, f"missing section {key!r} (expected a mapping)")
            return _LineDict()
        if not isinstance(value, dict):
            self.problem(_line_of(parent, key, line), f"{key!r} must be a mapping, got {_kind(value)}")
            return _LineDict()
        return value

    def names(self, raw: Any, line: int, what: str) -> tuple[str, ...]:
        """A state/event list may be one name or a list of names."""
        if isinstance(raw, str):
            return (raw,)
        if isinstance(raw, list) and raw and all(isinstance(x, str) for x in raw):
            return tuple(raw)
        self.problem(line, f"{what} must be a name or a non-empty list of names, got {raw!r}")
        return ()

    def name(self, raw: Any, line: int, what: str) -> str | None:
        """An optional single name (event, guard, dest); anything else is a problem."""
        if raw is None or isinstance(raw, str):
            return raw
        self.problem(line, f"{what} must be a name, got {raw!r}")
        return None

    def flag(self, entry: dict, key: str, line: int, what: str) -> bool:
        """An optional true/false; a string such as 'no' must not read as true."""
        value = entry.get(key, False)
        if not isinstance(value, bool):
            self.problem(_line_of(entry, key, line), f"{what}: {key!r} must be true or false, got {value!r}")
            return False
        return value

    def text(self, raw: Any, line: int, what: str) -> str:
        if raw is None:
            return ""
        if not isinstance(raw, str):
            self.problem(line, f"{what} must be text, got {_kind(raw)}")
            return ""
        return raw.strip()


def load_spec(path: str | Path) -> Spec:
    """Read and validate one spec file.

    Raises ``SpecError`` listing every problem with its ``file:line``; the spec is
    returned only when it passed every check in ``moriio_fsm.lang.validate``.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise SpecError([Problem(str(path), 0, f"cannot read spec: {exc.strerror}")]) from None
    spec = parse_spec(text, str(path))
    from .validate import validate_spec  # local import: validate depends on model only

    problems = validate_spec(spec)
    if problems:
        raise SpecError(problems)
    return spec


def parse_spec(text: str, path: str = "<string>") -> Spec:
    """Parse YAML text into a ``Spec`` without the structural checks of ``validate``.

    Raises ``SpecError`` for YAML syntax errors, duplicate keys, missing sections,
    wrong types and references to undeclared names.
    """
    try:
        loader = _LineLoader(text)
    except yaml.reader.ReaderError as exc:
        line = text.count("\n", 0, exc.position) + 1
        raise SpecError([Problem(path, line, f"invalid YAML: character {chr(exc.character)!r} is not "
                                             "allowed in a YAML file")]) from None
    loader.duplicate_keys = []
    try:
        raw = loader.get_single_data()
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = mark.line + 1 if mark is not None else 0
        raise SpecError([Problem(path, line, f"invalid YAML: {getattr(exc, 'problem', exc)}")]) from None
    finally:
        loader.dispose()
    r = _Reader(path)
    for line, key in loader.duplicate_keys:
        r.problem(line, f"duplicate key {key!r}: each name may appear once")
    if not isinstance(raw, dict):
        raise SpecError([Problem(path, 1, "a spec must be a YAML mapping at the top level")] + r.problems)

    known_top = {"name", "summary", "initial", "config", "context", "states", "events", "guards",
                 "effects", "timers", "transitions", "invariants"}
    for key in raw:
        if key not in known_top:
            r.problem(_line_of(raw, key, 1), f"unknown top-level key {key!r}; expected one of {', '.join(sorted(known_top))}")

    name = raw.get("name")
    if not isinstance(name, str) or not name:
        r.problem(_line_of(raw, "name", 1), "missing or empty 'name' (expected the machine's name)")
        name = "<unnamed>"
    summary = r.text(raw.get("summary"), _line_of(raw, "summary", 1), "summary")

    def valid_name(key: Any, line: int, what: str, attribute: bool = False) -> bool:
        """Names are identifiers; context fields and config keys become record attributes,
        so they also may not shadow the record's own attributes or expression functions."""
        if not isinstance(key, str) or not key.isidentifier():
            r.problem(line, f"{what} name {key!r} must be an identifier (letters, digits, underscores)")
            return False
        if attribute and (key in RESERVED_NAMES or key in FUNCTIONS or key.startswith("_")):
            r.problem(line, f"{what} name {key!r} is reserved; avoid "
                            f"{', '.join(sorted(RESERVED_NAMES | set(FUNCTIONS)))} and leading underscores")
            return False
        return True

    config: dict[str, ConfigKey] = {}
    raw_config = r.mapping(raw, "config", 1, required=False)
    for key, entry in raw_config.items():
        line = _line_of(raw_config, key, 1)
        if not valid_name(key, line, "config key", attribute=True):
            continue
        if not isinstance(entry, dict) or "default" not in entry:
            r.problem(line, f"config key {key!r} must be a mapping with a 'default'")
            continue
        default = entry["default"]
        if isinstance(default, bool) or not isinstance(default, (int, float)) \
                or not 0 < default < float("inf"):
            r.problem(line, f"config key {key!r}: default must be a positive finite number "
                            f"(a duration or a limit), got {default!r}")
            continue
        config[key] = ConfigKey(key, default, r.text(entry.get("doc"), line, "doc"), line)

    context: dict[str, ContextField] = {}
    raw_context = r.mapping(raw, "context", 1, required=False)
    for key, entry in raw_context.items():
        line = _line_of(raw_context, key, 1)
        if not valid_name(key, line, "context field", attribute=True):
            continue
        if key in config:
            r.problem(line, f"context field {key!r} has the name of a config key; names must differ")
            continue
        ftype = entry.get("type") if isinstance(entry, dict) else None
        if not isinstance(ftype, str) or ftype not in CONTEXT_TYPES:
            r.problem(line, f"context field {key!r} needs a type, one of {', '.join(CONTEXT_TYPES)}; "
                            f"got {ftype!r}")
            continue
        initial = entry.get("initial")
        if initial is None and ftype != "object":
            r.problem(line, f"context field {key!r} of type {ftype} needs an 'initial' value")
        elif initial is not None and not isinstance(initial, CONTEXT_TYPES[ftype]) or (
                ftype in ("int", "bitmap") and isinstance(initial, bool)):
            r.problem(line, f"context field {key!r}: initial value {initial!r} is not of type {ftype}")
        context[key] = ContextField(key, ftype, initial, r.text(entry.get("doc"), line, "doc"), line)

    states: dict[str, StateSpec] = {}
    raw_states = r.mapping(raw, "states", 1)
    for key, entry in raw_states.items():
        line = _line_of(raw_states, key, 1)
        if not valid_name(key, line, "state"):
            continue
        entry = entry if isinstance(entry, dict) else {}
        final = r.flag(entry, "final", line, f"state {key!r}")
        states[key] = StateSpec(key, r.text(entry.get("doc"), line, "doc"), final, line)

    events: dict[str, EventSpec] = {}
    raw_events = r.mapping(raw, "events", 1)
    for key, entry in raw_events.items():
        line = _line_of(raw_events, key, 1)
        if not valid_name(key, line, "event"):
            continue
        entry = entry if isinstance(entry, dict) else {}
        origin = entry.get("origin")
        if origin not in EVENT_ORIGINS:
            r.problem(line, f"event {key!r}: origin must be one of {', '.join(EVENT_ORIGINS)}, got {origin!r}")
            origin = "local"
        payload = entry.get("payload") or {}
        if not isinstance(payload, dict) or not all(isinstance(v, str) for v in payload.values()):
            r.problem(line, f"event {key!r}: payload must map field names to type names")
            payload = {}
        for field_name, type_name in payload.items():
            if type_name not in PAYLOAD_TYPES:
                r.problem(line, f"event {key!r}: payload field {field_name!r} has unknown type "
                                f"{type_name!r}; expected one of {', '.join(PAYLOAD_TYPES)}")
        creates = r.flag(entry, "creates", line, f"event {key!r}")
        if creates and origin != "local":
            r.problem(line, f"event {key!r} creates transfers but its origin is {origin!r}; "
                            "only local events may create a transfer (a peer's message never does)")
        events[key] = EventSpec(key, origin, r.text(entry.get("doc"), line, "doc"), dict(payload), creates, line)

    def named_docs(section: str) -> dict[str, tuple[str, int]]:
        out: dict[str, tuple[str, int]] = {}
        raw_section = r.mapping(raw, section, 1, required=False)
        for key, doc in raw_section.items():
            line = _line_of(raw_section, key, 1)
            if valid_name(key, line, section[:-1]):
                out[key] = (r.text(doc, line, f"{section[:-1]} {key!r} doc"), line)
        return out

    guards = named_docs("guards")
    effects = named_docs("effects")

    initial = raw.get("initial")
    initial_line = _line_of(raw, "initial", 1)
    if not isinstance(initial, str):
        r.problem(initial_line, "missing 'initial' (expected the name of the initial state)")
        initial = ""
    elif initial not in states:
        r.problem(initial_line, f"unknown state {initial!r} given as initial; known states: {', '.join(states)}")

    def check_state(state: str, line: int, where: str) -> None:
        if state not in states:
            r.problem(line, f"unknown state {state!r} in {where}; known states: {', '.join(states)}")

    def check_event(event: str, line: int, where: str) -> None:
        if event not in events:
            r.problem(line, f"unknown event {event!r} in {where}; known events: {', '.join(events)}")

    transitions: list[TransitionSpec] = []
    raw_transitions = raw.get("transitions")
    if raw_transitions is None:
        r.problem(_line_of(raw, "transitions", 1), "missing 'transitions' (expected a list)")
        raw_transitions = []
    elif not isinstance(raw_transitions, list):
        r.problem(_line_of(raw, "transitions", 1),
                  f"'transitions' must be a list, got {_kind(raw_transitions)}")
        raw_transitions = []
    allowed_keys = {"event", "source", "dest", "internal", "guard", "effects", "outcome"}
    for index, entry in enumerate(raw_transitions):
        line = _line_of(raw_transitions, index, 1)
        if not isinstance(entry, dict):
            r.problem(line, f"transition #{index} must be a mapping")
            continue
        for key in entry:
            if key not in allowed_keys:
                r.problem(_line_of(entry, key, line), f"transition #{index}: unknown key {key!r}; "
                                                      f"expected {', '.join(sorted(allowed_keys))}")
        event = r.name(entry.get("event"), _line_of(entry, "event", line), f"transition #{index} event")
        if event is not None:
            check_event(event, _line_of(entry, "event", line), f"transition #{index}")
        source_line = _line_of(entry, "source", line)
        sources = r.names(entry.get("source"), source_line, f"transition #{index} source")
        for i, s in enumerate(sources):
            check_state(s, _line_of(entry.get("source"), i, source_line), f"transition #{index} source")
        internal = r.flag(entry, "internal", line, f"transition #{index}")
        dest = r.name(entry.get("dest"), _line_of(entry, "dest", line), f"transition #{index} dest")
        if internal and dest is not None:
            r.problem(line, f"transition #{index} is internal and also names dest {dest!r}; choose one")
        if not internal and dest is None and entry.get("dest") is None:
            r.problem(line, f"transition #{index} needs a 'dest' state or 'internal: true'")
        if dest is not None:
            check_state(dest, _line_of(entry, "dest", line), f"transition #{index} dest")
        if entry.get("event") is None and internal:
            r.problem(line, f"transition #{index} is eventless and internal; an eventless "
                            "transition must change state or it would fire forever")
        guard = r.name(entry.get("guard"), _line_of(entry, "guard", line), f"transition #{index} guard")
        if guard is not None and guard not in guards:
            r.problem(_line_of(entry, "guard", line), f"unknown guard {guard!r} in transition #{index}; "
                                                      f"declare it under 'guards'")
        raw_effects = entry.get("effects")
        effects_line = _line_of(entry, "effects", line)
        effect_names = (r.names(raw_effects, effects_line, f"transition #{index} effects")
                        if raw_effects not in (None, []) else ())
        for i, e in enumerate(effect_names):
            if e not in effects:
                r.problem(_line_of(raw_effects, i, effects_line), f"unknown effect {e!r} in transition "
                                                                  f"#{index}; declare it under 'effects'")
        outcome = entry.get("outcome", "applied")
        if outcome not in TRANSITION_OUTCOMES:
            r.problem(_line_of(entry, "outcome", line), f"transition #{index}: outcome must be one of "
                                                        f"{', '.join(TRANSITION_OUTCOMES)}, got {outcome!r}")
        if outcome != "applied" and (effect_names or not internal):
            r.problem(line, f"transition #{index} declares outcome {outcome!r}, which is only for "
                            "internal transitions without effects")
        transitions.append(TransitionSpec(index, event, sources, dest if not internal else None, guard,
                                          tuple(effect_names), outcome, line))

    timers: dict[str, TimerSpec] = {}
    raw_timers = r.mapping(raw, "timers", 1, required=False)
    for key, entry in raw_timers.items():
        line = _line_of(raw_timers, key, 1)
        if not valid_name(key, line, "timer"):
            continue
        if not isinstance(entry, dict):
            r.problem(line, f"timer {key!r} must be a mapping with states, duration and event")
            continue
        states_line = _line_of(entry, "states", line)
        t_states = r.names(entry.get("states"), states_line, f"timer {key!r} states")
        for i, s in enumerate(t_states):
            check_state(s, _line_of(entry.get("states"), i, states_line), f"timer {key!r}")
        duration = entry.get("duration")
        if not isinstance(duration, str) or duration not in config:
            r.problem(_line_of(entry, "duration", line), f"timer {key!r}: duration must name a config key, "
                                                         f"got {duration!r}; known: {', '.join(config)}")
        event = entry.get("event")
        if not isinstance(event, str):
            r.problem(_line_of(entry, "event", line), f"timer {key!r} needs the 'event' it fires, "
                                                      f"as a name; got {event!r}")
            event = ""
        else:
            check_event(event, _line_of(entry, "event", line), f"timer {key!r}")
            if event in events and events[event].origin != "timer":
                r.problem(_line_of(entry, "event", line), f"timer {key!r} fires event {event!r}, "
                                                          "whose origin must be 'timer'")
        raw_restart = entry.get("restart_on")
        restart_line = _line_of(entry, "restart_on", line)
        restart = (r.names(raw_restart, restart_line, f"timer {key!r} restart_on")
                   if raw_restart not in (None, []) else ())
        for i, e in enumerate(restart):
            check_event(e, _line_of(raw_restart, i, restart_line), f"timer {key!r} restart_on")
        timers[key] = TimerSpec(key, t_states, str(duration), event, tuple(restart), line)

    invariants: list[InvariantSpec] = []
    raw_invariants = r.mapping(raw, "invariants", 1, required=False)
    for key, expr in raw_invariants.items():
        line = _line_of(raw_invariants, key, 1)
        if not isinstance(expr, str):
            r.problem(line, f"invariant {key!r} must be an expression string")
            continue
        invariants.append(InvariantSpec(key, expr, line))

    if r.problems:
        raise SpecError(r.problems)
    return Spec(name=name, summary=summary, path=path, initial=initial, config=config,
                context=context, states=states, events=events, guards=guards, effects=effects,
                transitions=tuple(transitions), timers=timers, invariants=tuple(invariants))

"""Reading a whole spec: its sections in one fixed order, into a ``Spec``.

Rules: a section may refer only to those read before it, so a name is checked against its
declaration; every problem is recorded with its line and one ``SpecError`` lists them all.
Each section's reader (``sections_data``, ``sections_events``, ``sections_code``,
``sections_moves``) gets the ``SpecReader`` that collects the problems; none raises.
"""

from __future__ import annotations

from .errors import SpecError
from .model import Spec
from .sections_code import read_actions, read_guards, read_invariants
from .sections_data import read_config, read_context, read_states
from .sections_events import read_emits, read_events
from .sections_moves import read_timers, read_transitions
from .spec_reader import SpecReader, listing
from .yaml_lines import line_of

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

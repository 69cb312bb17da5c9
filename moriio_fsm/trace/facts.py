"""What the trace tools read off a spec: message pairs, once-only effects, ways out of a state.

Rules: everything here is derived from the spec alone (no lifecycle rule is restated).
A *message* is an effect ``send_<x>`` of one spec whose peer declares a remote event
``<x>`` (``send_write_done`` -> ``write_done``). An effect is *once-only* when every row
that emits it changes state and no state it leads to can reach a state it is emitted
from again: a correct run emits it at most once per transfer, so twice is an anomaly.
Rows that stay in their state and answer a peer's event (P saying its verdict again when
D's release asks) are repeats the peer asked for: they neither make an effect
repeatable nor count as its second emission.
"""

from __future__ import annotations

from collections.abc import Iterable

from ..lang.model import Spec


def message_event(effect_kind: str) -> str | None:
    """The remote event an effect ``send_<x>`` becomes on the peer, or None."""
    return effect_kind[5:] if effect_kind.startswith("send_") and len(effect_kind) > 5 else None


def once_only_effects(spec: Spec) -> dict[str, frozenset[str]]:
    """Each once-only effect, with the peer events whose steps only repeat it."""
    successors: dict[str, set[str]] = {state: set() for state in spec.states}
    emitted_by: dict[str, list] = {}
    for row in spec.transitions:
        for source in row.sources:
            if row.dest is not None:
                successors[source].add(row.dest)
        for kind in row.emits:
            emitted_by.setdefault(kind, []).append(row)
    once = {}
    for kind, all_rows in emitted_by.items():
        answers = [row for row in all_rows if _answers_peer(spec, row)]
        rows = [row for row in all_rows if row not in answers]
        if not rows or any(row.dest is None or row.dest in row.sources for row in rows):
            continue
        sources = {s for row in rows for s in row.sources}
        reach = _reachable(successors, {row.dest for row in rows})
        if not reach & sources:
            once[kind] = frozenset(row.event for row in answers)
    return once


def _answers_peer(spec: Spec, row) -> bool:
    """A row that stays in its state, run by an event from the peer."""
    event = spec.events.get(row.event) if row.event else None
    return row.dest is None and event is not None and event.origin == "remote"


def _reachable(successors: dict[str, set[str]], start: Iterable[str]) -> set[str]:
    seen = set(start)
    stack = list(seen)
    while stack:
        for nxt in successors.get(stack.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                stack.append(nxt)
    return seen


def remote_events(spec: Spec) -> frozenset[str]:
    return frozenset(name for name, event in spec.events.items() if event.origin == "remote")


def ways_out(spec: Spec, state: str) -> dict[str, list[str]]:
    """Per origin (local, remote, adapter, timer), the events that can move a transfer
    on from ``state``: a row that leaves it, or one that changes its context (which may
    let an eventless row leave it). Duplicate and ignored rows are not ways out."""
    found: dict[str, list[str]] = {}
    for row in spec.transitions:
        if row.event is None or state not in row.sources or row.outcome != "applied":
            continue
        if row.dest in (None, state) and not row.actions:
            continue
        origin = spec.events[row.event].origin
        names = found.setdefault(origin, [])
        if row.event not in names:
            names.append(row.event)
    return found

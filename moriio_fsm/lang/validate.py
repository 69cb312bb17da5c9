"""Structural checks of a parsed spec: the rules that make a lifecycle safe.

Each check returns problems located at ``file:line``. A spec that passes has no
unreachable state, no state without a way out, absorbing final states, no pair of
transitions that no guard separates, timers that always find a row when they fire,
a backstop in every live state (a way out that needs neither the peer nor an adapter
to answer), and emits whose handlers' failures come back as events the spec handles.

Rules of this file: every check is linear (or n log n) in the size of the spec, and no
graph walk recurses, because a spec may have thousands of states and rows. Rows are
indexed once, by source state and by (event, source), and every check reads the index.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from .errors import Problem
from .expr import ExpressionError, compile_predicate
from .model import Spec, TransitionSpec

#: A cycle longer than this is shown by its ends only; the states between are counted.
_CYCLE_SHOWN = 20


#: A check reports a problem with ``add(line, message)``.
Add = Callable[[int, str], None]


@dataclass
class _Rows:
    """Every row by source state and by (event, source), in row order (event None:
    eventless), and the states each state's rows lead to (state-changing rows only)."""

    rows_from: dict[str, list[TransitionSpec]] = field(default_factory=lambda: defaultdict(list))
    by_trigger: dict[tuple[str | None, str], list[TransitionSpec]] = field(
        default_factory=lambda: defaultdict(list)
    )
    edges: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))

    @classmethod
    def of(cls, spec: Spec) -> _Rows:
        rows = cls()
        for t in spec.transitions:
            for s in t.sources:
                rows.rows_from[s].append(t)
                rows.by_trigger[(t.event, s)].append(t)
                if t.dest is not None and t.dest != s:
                    rows.edges[s].add(t.dest)
        return rows


def validate_spec(spec: Spec) -> list[Problem]:
    """Return every structural problem of ``spec`` (empty when it is sound), the checks
    in a fixed order."""
    problems: list[Problem] = []

    def add(line: int, message: str) -> None:
        problems.append(Problem(spec.path, line, message))

    rows = _Rows.of(spec)
    _final_states_absorb(spec, add)
    _every_state_reachable(spec, rows, add)
    _every_live_state_can_end(spec, rows, add)
    _guards_separate_rows(spec, rows, add)
    _eventless_rows_do_not_cycle(spec, add)
    _timers_always_find_a_row(spec, rows, add)
    _failed_effects_come_back(spec, rows, add)
    _creation_is_handled(spec, rows, add)
    _every_name_is_used(spec, add)
    _invariants_type_check(spec, add)
    return problems


def _final_states_absorb(spec: Spec, add: Add) -> None:
    """Final states are absorbing: nothing may start from them."""
    for t in spec.transitions:
        for s in t.sources:
            if s in spec.states and spec.states[s].final:
                add(
                    t.line,
                    f"final state {s!r} has an outgoing {t.label()}; final states are absorbing",
                )


def _every_state_reachable(spec: Spec, rows: _Rows, add: Add) -> None:
    if spec.initial not in spec.states:
        return
    seen = {spec.initial}
    queue = deque([spec.initial])
    while queue:
        for nxt in rows.edges[queue.popleft()]:
            if nxt not in seen:
                seen.add(nxt)
                queue.append(nxt)
    for name, state in spec.states.items():
        if name not in seen:
            add(
                state.line,
                f"unreachable state {name!r}: no transition path leads to it from "
                f"initial state {spec.initial!r}",
            )


def _every_live_state_can_end(spec: Spec, rows: _Rows, add: Add) -> None:
    """Every live state needs a way out, a path to an end, and an exit that does not wait
    on the peer (a local event, a timer, or an eventless transition)."""
    armed: dict[str, set[str]] = defaultdict(set)  # the events of the timers armed in each
    for timer in spec.timers.values():
        for s in timer.states:
            armed[s].add(timer.event)
    finals = set(spec.final_states)
    reaches_final = _reaching(finals, rows.edges)
    if not finals:
        add(spec.line, "the spec has no final state; every transfer must be able to end")
    peer_free_ends = ends_without_peer(spec, rows.rows_from)
    for name, state in spec.states.items():
        if state.final:
            continue
        if not rows.edges[name]:
            add(state.line, f"non-final state {name!r} has no way out: no transition leaves it")
            continue
        if name not in reaches_final:
            add(state.line, f"non-final state {name!r} can never reach a final state")
        if not _has_backstop(spec, name, rows.rows_from[name], armed.get(name, set())):
            add(
                state.line,
                f"state {name!r} waits only on peers or adapters: no local event, no "
                "timer armed in it (that the peer cannot keep postponing) and no "
                "unguarded eventless step can take a transfer out of it; arm a timer "
                "in it whose firing leaves it (a backstop), so the transfer cannot "
                "hang when nobody answers",
            )
        elif name in reaches_final and name not in peer_free_ends:
            add(
                state.line,
                f"state {name!r} cannot end without a peer or an adapter: no sequence "
                "of local events, timers and eventless steps from it reaches a final "
                "state (timers that only lead on to more waiting, or that a peer "
                "keeps restarting, do not count), so a transfer in it can wait forever",
            )


def _reaching(targets: set[str], edges: dict[str, set[str]]) -> set[str]:
    """``targets`` and every state with a path to one of them: one walk backwards."""
    into: dict[str, set[str]] = defaultdict(set)
    for s, dests in edges.items():
        for d in dests:
            into[d].add(s)
    reached = set(targets)
    pending = deque(targets)
    while pending:
        for prev in into[pending.popleft()]:
            if prev not in reached:
                reached.add(prev)
                pending.append(prev)
    return reached


def _guards_separate_rows(spec: Spec, rows: _Rows, add: Add) -> None:
    """Two transitions for one (event, source) must be separated by guards, tried in
    order. A row can never fire when an earlier one has no guard or the same guard; each
    such row is reported once, against the earliest row that shadows it. One pass per
    trigger: comparing every pair would be quadratic in a table of thousands of rows."""
    for (event, source), candidates in rows.by_trigger.items():
        unguarded: TransitionSpec | None = None
        first_with: dict[str, TransitionSpec] = {}
        for later in candidates:
            guard = later.guard
            shadows = [
                r
                for r in (unguarded, first_with.get(guard) if guard is not None else None)
                if r is not None
            ]
            if shadows:
                first = min(shadows, key=lambda r: r.index)
                why = (
                    "the first has no guard"
                    if first.guard is None
                    else f"both use guard {first.guard!r}"
                )
                add(
                    later.line,
                    f"transitions #{first.index} and #{later.index} both handle "
                    f"{'eventless step' if event is None else 'event ' + repr(event)} "
                    f"in state {source!r} and no guard separates them ({why}); "
                    f"#{later.index} can never fire",
                )
            if guard is None:
                unguarded = unguarded or later
            else:
                first_with.setdefault(guard, later)


def _eventless_rows_do_not_cycle(spec: Spec, add: Add) -> None:
    """Eventless transitions must not form a cycle, or one step could loop forever."""
    eventless: dict[str, set[str]] = defaultdict(set)
    for t in spec.transitions:
        if t.event is None and t.dest is not None:
            for s in t.sources:
                eventless[s].add(t.dest)
    for cycle in _eventless_cycles(eventless, [s for s in sorted(eventless) if s in spec.states]):
        state = spec.states.get(cycle[0])
        add(
            state.line if state else spec.line,
            "eventless transitions form a cycle: " + _show_path(cycle),
        )


def _timers_always_find_a_row(spec: Spec, rows: _Rows, add: Add) -> None:
    """Timers only make sense on live states, and each armed state must say what its
    timer's firing means, whatever the guards say: a firing no row takes would be
    rejected, the timer would be gone and the transfer could wait forever."""
    for timer in spec.timers.values():
        for s in timer.states:
            if s in spec.states and spec.states[s].final:
                add(
                    timer.line,
                    f"timer {timer.name!r} is armed in final state {s!r}; a final state "
                    "never leaves, so the timer could only fire into nothing",
                )
                continue
            handling = rows.by_trigger.get((timer.event, s), [])
            if s in spec.states and not handling:
                add(
                    timer.line,
                    f"timer {timer.name!r} is armed in state {s!r} but no transition "
                    f"handles its event {timer.event!r} there; add one (it may be "
                    "'outcome: ignored')",
                )
            elif handling and handling[-1].guard is not None:
                add(
                    handling[-1].line,
                    f"timer {timer.name!r} fires {timer.event!r} in state {s!r} "
                    f"where every row has a guard "
                    f"({_listing([repr(t.guard) for t in handling])}); "
                    "when none holds the firing is rejected and the timer is "
                    "lost: end with an unguarded row (it may be 'outcome: ignored')",
                )


def _failed_effects_come_back(spec: Spec, rows: _Rows, add: Add) -> None:
    """What a driver must do when the handler of an emitted effect fails: the emit names
    an event the transfer receives, which must be the adapter's and handled wherever
    the emitting rows leave the transfer alive."""
    emitting_rows: dict[str, list] = defaultdict(list)
    for t in spec.transitions:
        for e in t.emits:
            emitting_rows[e].append(t)
    for name, emit in spec.emits.items():
        alive_after = sorted(
            {
                t.dest or s
                for t in emitting_rows[name]
                for s in t.sources
                if (t.dest or s) in spec.states and not spec.states[t.dest or s].final
            }
        )
        if emit.on_failure is None:
            if alive_after:
                add(
                    emit.line,
                    f"emit {name!r} has no on_failure event, but rows emitting it leave "
                    f"the transfer alive in {_listing(alive_after)}; name the event a "
                    "driver dispatches when its handler fails, so no transfer is lost",
                )
            continue
        event = spec.events.get(emit.on_failure)
        if event is None:
            continue  # the loader reported the unknown name
        if event.origin != "adapter":
            add(
                emit.line,
                f"emit {name!r}: on_failure event {event.name!r} must have origin "
                f"'adapter' (the driver reports its own failure), not {event.origin!r}",
            )
        missing = sorted(set(event.payload) - set(emit.fields) - {"error"})
        if missing:
            add(
                emit.line,
                f"emit {name!r}: on_failure event {event.name!r} declares payload "
                f"field(s) {', '.join(missing)} that the effect does not carry; a "
                "driver can only fill fields of the effect, and 'error'",
            )
        for s in alive_after:
            if not rows.by_trigger.get((event.name, s)):
                add(
                    emit.line,
                    f"emit {name!r}: its on_failure event {event.name!r} is not handled "
                    f"in state {s!r}, where rows emitting it leave the transfer",
                )


def _creation_is_handled(spec: Spec, rows: _Rows, add: Add) -> None:
    """Creation: exactly the local 'creates' events, each handled in the initial state."""
    creators = [e for e in spec.events.values() if e.creates]
    if not creators:
        add(spec.line, "no event is marked 'creates: true'; a transfer could never start")
    for e in creators:
        if not rows.by_trigger.get((e.name, spec.initial)):
            add(
                e.line,
                f"creating event {e.name!r} has no transition from initial state {spec.initial!r}",
            )


def _every_name_is_used(spec: Spec, add: Add) -> None:
    """Declared names that nothing uses are dead text that drifts from the truth."""
    used_guards = {t.guard for t in spec.transitions if t.guard}
    used_actions = {a for t in spec.transitions for a in t.actions}
    used_emits = {e for t in spec.transitions for e in t.emits}
    used_events = {t.event for t in spec.transitions if t.event} | {
        tm.event for tm in spec.timers.values()
    }
    for kind, declared, used in (
        ("guard", spec.guards, used_guards),
        ("action", spec.actions, used_actions),
        ("emit", spec.emits, used_emits),
    ):
        for name, item in declared.items():
            if name not in used:
                add(item.line, f"{kind} {name!r} is declared but no transition uses it")
    for name, event in spec.events.items():
        if name not in used_events:
            add(event.line, f"event {name!r} is declared but no transition handles it")


def _invariants_type_check(spec: Spec, add: Add) -> None:
    """Invariants are type-checked against the context's types ('state' is the state's
    name), so a wrong-typed one fails here and not in the middle of a checked run."""
    types = {name: f.type for name, f in spec.context.items()}
    types["state"] = "str"
    for inv in spec.invariants:
        try:
            compile_predicate(inv.expr, types, types=types)
        except ExpressionError as exc:
            add(inv.line, f"invariant {inv.name!r}: {exc}")


def _eventless_cycles(eventless: dict[str, set[str]], roots: list[str]) -> list[list[str]]:
    """Cycles of the eventless graph, each as the path that closes it (``a -> b -> a``).

    A depth-first walk with an explicit stack (a chain of thousands of eventless rows
    would exhaust Python's stack if it recursed), visiting successors in sorted order so
    that the report is the same on every run. Each back edge found is one cycle.
    """
    visiting, done = 1, 2
    color: dict[str, int] = {}
    cycles: list[list[str]] = []
    for root in roots:
        if color.get(root) == done:
            continue
        path = [root]
        position = {root: 0}
        color[root] = visiting
        successors = [iter(sorted(eventless.get(root, ())))]
        while successors:
            nxt = next(successors[-1], None)
            if nxt is None:
                successors.pop()
                node = path.pop()
                del position[node]
                color[node] = done
                continue
            seen = color.get(nxt)
            if seen == done:
                continue
            if seen == visiting:
                cycles.append(path[position[nxt] :] + [nxt])
                continue
            color[nxt] = visiting
            position[nxt] = len(path)
            path.append(nxt)
            successors.append(iter(sorted(eventless.get(nxt, ()))))
    return cycles


def _listing(items: list[str], shown: int = 20) -> str:
    """``a, b, c``; a long list shows its first items and counts the rest."""
    if len(items) <= shown:
        return ", ".join(items)
    return ", ".join(items[:shown]) + f", ... ({len(items) - shown} more)"


def _show_path(cycle: list[str]) -> str:
    """``a -> b -> a``; a long cycle shows its first and last states and counts the rest."""
    if len(cycle) <= _CYCLE_SHOWN:
        return " -> ".join(cycle)
    half = _CYCLE_SHOWN // 2
    return (
        " -> ".join(cycle[:half])
        + f" -> ... ({len(cycle) - 2 * half} more) -> "
        + " -> ".join(cycle[-half:])
    )


def _usable_timer_events(spec: Spec, state: str, rows: list[TransitionSpec]) -> set[str]:
    """Events of the timers armed in ``state`` that the peer cannot postpone forever: a
    timer that an applied row of a peer's event restarts there does not count (adapters
    are this side's own code and report on bounded work; a peer may not be)."""
    peer_applied = {
        t.event
        for t in rows
        if t.event is not None
        and t.outcome == "applied"
        and spec.events.get(t.event) is not None
        and spec.events[t.event].origin == "remote"
    }
    return {
        tm.event
        for tm in spec.timers.values()
        if state in tm.states and not set(tm.restart_on) & peer_applied
    }


def _peer_free_moves(spec: Spec, state: str, rows: list[TransitionSpec]) -> set[str]:
    """States a transfer in ``state`` can move to without the peer or an adapter.

    A move is an eventless row leaving the state; a row taken on a local event or on a
    usable timer (see ``_usable_timer_events``) that leaves it; or such a row whose
    actions write a field that the guard of an eventless row leaving the state reads
    (the host's request lifecycle or the clock can then enable that exit). Guards are
    opaque here, so this is the structural half of the proof; the model checker explores
    the bindings themselves.
    """
    moves: set[str] = set()
    exits = [t for t in rows if t.event is None and t.dest not in (None, state)]
    moves.update(t.dest for t in exits if t.guard is None and t.dest is not None)
    timers = _usable_timer_events(spec, state, rows)
    exit_reads: dict[str, set[str]] = {}
    for t in exits:
        if t.guard in spec.guards:
            for name in spec.guards[t.guard].reads:
                if t.dest is not None:
                    exit_reads.setdefault(name, set()).add(t.dest)
    for t in rows:
        event = spec.events.get(t.event) if t.event is not None else None
        if event is None or not (event.origin == "local" or t.event in timers):
            continue
        if t.dest not in (None, state):
            moves.add(t.dest)
            continue
        for action in t.actions:
            for written in spec.actions[action].writes if action in spec.actions else ():
                moves.update(exit_reads.get(written, ()))
    return moves


def _has_backstop(
    spec: Spec,
    state: str,
    rows: list[TransitionSpec] | None = None,
    armed_timer_events: set[str] | None = None,
) -> bool:
    """True when a transfer in ``state`` has at least one move that needs neither the
    peer nor an adapter (``_peer_free_moves``). ``armed_timer_events`` is accepted for
    callers that index it; the usable timers are worked out here."""
    if rows is None:
        rows = [t for t in spec.transitions if state in t.sources]
    return bool(_peer_free_moves(spec, state, rows))


def ends_without_peer(spec: Spec, rows_from: dict[str, list[TransitionSpec]]) -> set[str]:
    """The states from which some sequence of peer-free moves reaches a final state
    (one walk backwards from the finals)."""
    moves = {
        state: _peer_free_moves(spec, state, rows_from.get(state, [])) for state in spec.states
    }
    return _reaching(set(spec.final_states), moves)

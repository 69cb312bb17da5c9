"""Structural checks of a parsed spec: the rules that make a lifecycle safe.

Each check returns problems located at ``file:line``. A spec that passes has no
unreachable state, no state without a way out, absorbing final states, no pair
of transitions that no guard separates, no timer on a final state, and a way out
of every live state that does not depend on the peer behaving.
"""

from __future__ import annotations

from collections import defaultdict, deque

from .errors import Problem
from .expr import ExpressionError, compile_predicate
from .model import Spec


def validate_spec(spec: Spec) -> list[Problem]:
    """Return every structural problem of ``spec`` (empty when it is sound)."""
    problems: list[Problem] = []

    def add(line: int, message: str) -> None:
        problems.append(Problem(spec.path, line, message))

    # Outgoing edges per state (state-changing transitions only).
    edges: dict[str, set[str]] = defaultdict(set)
    for t in spec.transitions:
        for s in t.sources:
            if t.dest is not None and t.dest != s:
                edges[s].add(t.dest)

    # Final states are absorbing: nothing may start from them.
    for t in spec.transitions:
        for s in t.sources:
            if s in spec.states and spec.states[s].final:
                add(t.line, f"final state {s!r} has an outgoing {t.label()}; final states are absorbing")

    # Reachability from the initial state.
    if spec.initial in spec.states:
        seen = {spec.initial}
        queue = deque([spec.initial])
        while queue:
            for nxt in edges[queue.popleft()]:
                if nxt not in seen:
                    seen.add(nxt)
                    queue.append(nxt)
        for name, state in spec.states.items():
            if name not in seen:
                add(state.line, f"unreachable state {name!r}: no transition path leads to it from "
                                f"initial state {spec.initial!r}")

    # Every live state needs a way out, a path to an end, and an exit that does not
    # wait on the peer (a local event, a timer, or an eventless transition).
    finals = set(spec.final_states)
    reaches_final = set(finals)
    changed = True
    while changed:
        changed = False
        for s in spec.states:
            if s not in reaches_final and edges[s] & reaches_final:
                reaches_final.add(s)
                changed = True
    if not finals:
        add(spec.line, "the spec has no final state; every transfer must be able to end")
    for name, state in spec.states.items():
        if state.final:
            continue
        if not edges[name]:
            add(state.line, f"non-final state {name!r} has no way out: no transition leaves it")
            continue
        if name not in reaches_final:
            add(state.line, f"non-final state {name!r} can never reach a final state")
        # Only a transition that changes state is a way out; an internal one leaves the
        # transfer where it was, however local its event.
        exits = [t for t in spec.transitions
                 if name in t.sources and t.dest is not None and t.dest != name]
        peer_free = [t for t in exits
                     if t.event is None or spec.events[t.event].origin != "remote"]
        if not peer_free:
            add(state.line, f"state {name!r} can only be left by peer messages; add a timer, a "
                            "local failure or an abort so the transfer cannot hang")

    # Two transitions for one (event, source) must be separated by guards, tried in order.
    by_trigger: dict[tuple[str | None, str], list] = defaultdict(list)
    for t in spec.transitions:
        for s in t.sources:
            by_trigger[(t.event, s)].append(t)
    for (event, source), candidates in by_trigger.items():
        for i, first in enumerate(candidates):
            for later in candidates[i + 1:]:
                if first.guard is None or first.guard == later.guard:
                    why = ("the first has no guard" if first.guard is None
                           else f"both use guard {first.guard!r}")
                    add(later.line, f"transitions #{first.index} and #{later.index} both handle "
                                    f"{'eventless step' if event is None else 'event ' + repr(event)} "
                                    f"in state {source!r} and no guard separates them ({why}); "
                                    f"#{later.index} can never fire")

    # Eventless transitions must not form a cycle, or one step could loop forever.
    eventless: dict[str, set[str]] = defaultdict(set)
    for t in spec.transitions:
        if t.event is None and t.dest is not None:
            for s in t.sources:
                eventless[s].add(t.dest)
    visiting: set[str] = set()
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> None:
        if node in done:
            return
        if node in visiting:
            cycle = path[path.index(node):] + [node]
            add(spec.states[node].line, "eventless transitions form a cycle: " + " -> ".join(cycle))
            return
        visiting.add(node)
        for nxt in sorted(eventless[node]):
            visit(nxt, path + [node])
        visiting.discard(node)
        done.add(node)

    for s in sorted(eventless):
        if s in spec.states:
            visit(s, [])

    # Timers only make sense on live states, and each armed state must say what its
    # timer's firing means: an unhandled firing would be rejected and the timer lost.
    for timer in spec.timers.values():
        for s in timer.states:
            if s in spec.states and spec.states[s].final:
                add(timer.line, f"timer {timer.name!r} is armed in final state {s!r}; a final state "
                                "never leaves, so the timer could only fire into nothing")
            elif s in spec.states and not any(t.event == timer.event and s in t.sources
                                              for t in spec.transitions):
                add(timer.line, f"timer {timer.name!r} is armed in state {s!r} but no transition "
                                f"handles its event {timer.event!r} there; add one (it may be "
                                "'outcome: ignored')")

    # Creation: exactly the local 'creates' events, each handled in the initial state.
    creators = [e for e in spec.events.values() if e.creates]
    if not creators:
        add(spec.line, "no event is marked 'creates: true'; a transfer could never start")
    for e in creators:
        if not any(t.event == e.name and spec.initial in t.sources for t in spec.transitions):
            add(e.line, f"creating event {e.name!r} has no transition from initial state {spec.initial!r}")

    # Declared names that nothing uses are dead text that drifts from the truth.
    used_guards = {t.guard for t in spec.transitions if t.guard}
    used_effects = {e for t in spec.transitions for e in t.effects}
    used_events = ({t.event for t in spec.transitions if t.event}
                   | {tm.event for tm in spec.timers.values()})
    for name, (_, line) in spec.guards.items():
        if name not in used_guards:
            add(line, f"guard {name!r} is declared but no transition uses it")
    for name, (_, line) in spec.effects.items():
        if name not in used_effects:
            add(line, f"effect {name!r} is declared but no transition uses it")
    for name, event in spec.events.items():
        if name not in used_events:
            add(event.line, f"event {name!r} is declared but no transition handles it")

    for inv in spec.invariants:
        try:
            compile_predicate(inv.expr, spec.context)
        except ExpressionError as exc:
            add(inv.line, f"invariant {inv.name!r}: {exc}")
    return problems

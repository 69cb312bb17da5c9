"""Generate one Python function per (state, event) pair of a compiled machine.

The hot path of ``TransferTable.dispatch`` calls the generated function for the
transfer's state and the event's kind. Each function tries that pair's rows in spec
order, calls the bound guards and effects directly (no loops over tuples), and returns
a ready ``Result`` after counting its outcome in ``shard.counts``; rows whose outcome
needs no follow-up (no state change, no eventless transition enabled) return at once,
with timer restarts done inline; every other row hands over to ``finish``.
"""

from __future__ import annotations

from typing import Any, Callable

from .events import Outcome


def generate_steps(machine, result_cls, finish: Callable, arm: Callable,
                   restarts: dict[str, tuple[tuple[int, float, frozenset], ...]],
                   special_kinds: frozenset, no_effects: tuple) -> dict[str, dict[str, Callable]]:
    """Return ``steps[state][kind] -> fn(shard, t, ev) -> Result`` for ``machine``.

    ``finish(shard, t, ev, outcome, dest, out)`` completes rows that change state or
    enable an eventless transition. ``restarts[kind]`` lists ``(timer index, duration,
    armed states)`` for the timers an applied ``kind`` (re)arms while the transfer is in
    one of those states; the generated code does that inline, calling ``arm(t, index,
    now)`` when the timer is not armed. ``special_kinds`` are left out: the table
    handles them on its general path. ``no_effects`` is the table's shared empty tuple.
    """
    namespace: dict[str, Any] = {"Result": result_cls, "finish": finish, "arm": arm,
                                 "NO_EFFECTS": no_effects}
    names: dict[int, str] = {}

    def bind(obj: Any, prefix: str) -> str:
        key = id(obj)
        if key not in names:
            names[key] = f"{prefix}{len(names)}"
            namespace[names[key]] = obj
        return names[key]

    steps: dict[str, dict[str, Callable]] = {}
    for state, rows_by_kind in machine.table.items():
        steps[state] = {}
        eventless_guards = [row[0] for row in machine.eventless[state]]
        for kind, rows in rows_by_kind.items():
            if kind in special_kinds:
                continue
            lines = ["def step(shard, t, ev):"]
            for guard, dest, effects, outcome, index in rows:
                indent = "    "
                if guard is not None:
                    lines.append(f"    if {bind(guard, 'g')}(t, ev):  # transition #{index}")
                    indent = "        "
                else:
                    lines.append(f"    # transition #{index}")
                outcome_name = bind(outcome, "o")
                if dest == state:
                    dest = None     # a self-loop is not a state change (no exit, no timers)
                if effects:
                    lines.append(f"{indent}out = []")
                    for effect in effects:
                        lines.append(f"{indent}{bind(effect, 'e')}(t, ev, out)")
                else:
                    lines.append(f"{indent}out = NO_EFFECTS")
                if dest is not None:
                    lines.append(f"{indent}return finish(shard, t, ev, {outcome_name}, "
                                 f"{dest!r}, out)")
                    if guard is None:
                        break
                    continue
                if outcome is Outcome.APPLIED:
                    if eventless_guards:
                        # Any eventless row may now be enabled: let finish run them.
                        test = " or ".join("True" if g is None else f"{bind(g, 'g')}(t, ev)"
                                           for g in eventless_guards)
                        lines.append(f"{indent}if {test}:")
                        lines.append(f"{indent}    return finish(shard, t, ev, {outcome_name}, "
                                     f"None, out)")
                    for timer_index, duration, armed_in in restarts.get(kind, ()):
                        if state not in armed_in:
                            continue
                        lines.append(f"{indent}if t.deadlines[{timer_index}] is None:")
                        lines.append(f"{indent}    arm(t, {timer_index}, ev.time)")
                        lines.append(f"{indent}else:")
                        lines.append(f"{indent}    t.deadlines[{timer_index}] = ev.time + "
                                     f"{duration!r}")
                cached = bind(result_cls(outcome, state, ()), "r")
                lines.append(f"{indent}shard.counts[{outcome.index}] += 1")
                if effects:
                    lines.append(f"{indent}return Result({outcome_name}, {state!r}, out) "
                                 f"if out else {cached}")
                else:
                    lines.append(f"{indent}return {cached}")
                if guard is None:
                    break   # the validator guarantees nothing after an unguarded row
            else:
                lines.append(f"    shard.counts[{Outcome.REJECTED.index}] += 1")
                lines.append(f"    return {bind(result_cls(Outcome.REJECTED, state, ()), 'r')}")
            source = "\n".join(lines)
            code = compile(source, f"<{machine.spec.name}:{state}:{kind}>", "exec")
            local: dict[str, Any] = {}
            exec(code, namespace, local)   # noqa: S102 - source built above from the spec
            fn = local["step"]
            fn.__qualname__ = f"{machine.spec.name}.{state}.{kind}"
            fn.source = source
            steps[state][kind] = fn
    return steps

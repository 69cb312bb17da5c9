"""``explain``: one transfer's timeline across every traced side, and why it is where it is.

Rules: the request's steps (the transfer's own and its peers', found by link) are
replayed, so states and armed timers are the machines' own, not guesses. The timeline
is sorted by wall clock (each side's ``t`` is its own clock). The reason is built from
the spec (the state's doc, the events that can move it on, by origin) and from the
peers' traces: for each remote event the transfer waits for, who could send it, who
did, and what became of those who did not.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from ..runtime.timers import TimerPlan
from .facts import ways_out
from .reader import printable
from .replay import ReplayReport, TransferSummary, replay


@dataclass
class Explanation:
    transfer: str
    report: ReplayReport
    timeline: list[tuple] = field(default_factory=list)  # (wall/t, t, side, transfer, step)
    reasons: list[str] = field(default_factory=list)

    @property
    def found(self) -> bool:
        return bool(self.timeline)

    def render(self, width: int = 40) -> str:
        if not self.found:
            return f"transfer {self.transfer!r}: no step of it (or of its request) in the trace"
        sides = sorted({row[2] for row in self.timeline})
        lines = [
            f"transfer {self.transfer!r}: {len(self.timeline)} steps on "
            f"{len(sides)} side(s) ({', '.join(map(printable, sides))}), sorted by wall "
            "clock",
            f"  {'t':>10}  {'side':<6} {'transfer':<14} {'event':<22} {'outcome':<9} "
            f"{'state':<28} effects",
        ]
        for _, t, side, tid, step in self.timeline:
            # Everything but t is text from the trace: shown escaped, one line per step.
            moved = (
                f"{step.before or '-'} -> {step.after or '-'}"
                if step.before != step.after
                else f"{step.after or '-'}"
            )
            effects = ", ".join(printable(e.get("kind", "?")) for e in step.effects)
            lines.append(
                f"  {t:>10.4f}  {printable(side):<6} {printable(tid):<14} "
                f"{printable(step.event):<22} {printable(step.outcome):<9} "
                f"{printable(moved):<28} {effects}".rstrip()
            )
        lines.append("")
        lines.extend(f"why: {reason}" for reason in self.reasons)
        return "\n".join(lines)


def explain(paths: Iterable[str], transfer: str, **replay_options) -> Explanation:
    report = replay(list(paths), transfer=transfer, collect=True, **replay_options)
    found = Explanation(transfer, report)
    summaries = [s for s in report.transfers.values() if s.steps]
    for s in summaries:
        for step in s.steps or ():
            order = step.wall if step.wall is not None else step.t
            found.timeline.append((order, step.t, s.side, s.transfer, step))
    found.timeline.sort(key=lambda row: (row[0], row[2], row[4].seq))
    targets = [s for s in summaries if s.transfer == transfer] or summaries
    stuck = [s for s in targets if _key(s) in report.live]
    for s in stuck or targets:
        found.reasons.append(_why(s, summaries, report))
    return found


def _key(s: TransferSummary) -> tuple:
    return (s.side, s.table, s.transfer)


def _why(s: TransferSummary, group: list[TransferSummary], report: ReplayReport) -> str:
    spec = s.spec
    state = s.state
    doc = " ".join(spec.states[state].doc.split()).rstrip(".") if state in spec.states else ""
    if s.partial:
        return (
            f"{s.who}: its trace starts mid-way (the first step kept is in {state!r}), so "
            "it cannot be replayed; the timeline shows what was kept"
        )
    live = report.live.get(_key(s))
    if live is None:
        return _ended(s, doc)
    # The trace ends at the last step of any side, measured on this side's clock.
    end = s.since + (report.end_wall - s.since_wall)
    parts = [
        f"{s.who} is stuck in {state!r}{f' ({doc})' if doc else ''} for "
        f"{end - s.since:.3f} s at the end of the traces, last event {s.last_event} at "
        f"t={s.last_t:.3f}"
    ]
    exits = ways_out(spec, state) if state is not None else {}
    if exits.get("remote"):
        parts.append(_waits_for(s, exits["remote"], group))
    others = [
        f"{', '.join(names)} ({origin})"
        for origin, names in exits.items()
        if origin not in ("remote", "timer")
    ]
    timers = _armed_timers(s, live, end)
    tail = []
    if others:
        tail.append("on " + " or ".join(others))
    if timers:
        tail.append(" or ".join(timers))
    if tail:
        parts.append(f"otherwise it leaves {state!r} {' or '.join(tail)}")
    return "; ".join(parts) + "."


#: Outcomes of a step that ran a row: only such a step can have made a transfer final.
_MOVED = ("created", "applied")


def _ended(s: TransferSummary, doc: str) -> str:
    """Why a transfer that ended is where it is: the step that made it final (not the
    events that came after and found it ended), and those later events."""
    steps = s.steps or []
    if s.state is None and steps:
        last = steps[-1]
        return (
            f"{s.who} never existed here: its {len(steps)} event(s) found no transfer "
            f"(the last, {printable(last.event)} at t={last.t:.3f}, was "
            f"{printable(last.outcome)})."
        )
    final = next(
        (
            i
            for i in range(len(steps) - 1, -1, -1)
            if steps[i].outcome in _MOVED and steps[i].after == s.state
        ),
        None,
    )
    text = f"{s.who} ended {s.state!r} at t={s.since:.3f}"
    if final is not None:
        step = steps[final]
        text += printable(f" after {step.event} ({step.before or 'no state'} -> {step.after})")
    if doc:
        text += f" ({doc})"
    later = steps[final + 1 :] if final is not None else []
    if later:
        shown = ", ".join(
            printable(f"{step.event} at t={step.t:.3f} ({step.outcome})") for step in later[:3]
        )
        text += (
            f"; {len(later)} later event(s) found it ended: {shown}"
            f"{', ...' if len(later) > 3 else ''}"
        )
    return text + "."


def _waits_for(s: TransferSummary, events: list[str], group: list[TransferSummary]) -> str:
    """What the peers' traces say about the remote events ``s`` waits for."""
    wanted = " or ".join(events)
    senders = [
        o
        for o in group
        if o.side != s.side and any(f"send_{event}" in o.spec.emits for event in events)
    ]
    arrived = [(kind, source) for kind, _, source in s.arrivals if kind in events]
    heard = sorted(
        {f"{kind} from {printable(source)}" if source else kind for kind, source in arrived}
    )
    sources = {source for _, source in arrived if source}
    got = f"{len(arrived)} arrived" + (f" ({', '.join(heard)})" if heard else "")
    if not senders:
        return f"it waits for {wanted}; {got}; no peer that sends it is in the traces given"
    text = [
        f"it waits for {wanted} from {len(senders)} peer(s) "
        f"({', '.join(f'{printable(o.side)} {o.transfer!r}' for o in senders)}); {got}"
    ]
    for o in senders:
        if o.side in sources:
            continue
        sent = [(kind, t) for kind, t in o.sends if kind in events]
        if sent:
            kind, t = sent[0]
            text.append(
                f"{printable(o.side)}'s trace shows its transfer {o.transfer!r} "
                f"{_fate(o)} and sent {kind} at t={t:.3f}, which never arrived"
            )
        else:
            text.append(
                f"{printable(o.side)}'s trace shows its transfer {o.transfer!r} "
                f"{_fate(o)} without sending {wanted}"
            )
    return "; ".join(text)


def _fate(o: TransferSummary) -> str:
    if o.state in o.spec.final_states:
        return f"ended {o.state!r} at t={o.since:.3f}"
    return f"is itself stuck in {o.state!r} since t={o.since:.3f}"


def _armed_timers(s: TransferSummary, tx, end: float) -> list[str]:
    plan = TimerPlan(s.spec, tx.config)
    found = []
    for index, deadline in enumerate(tx.deadlines):
        if deadline is None:
            continue
        when = "after the trace ends" if deadline > end else "before the trace ends (not fired)"
        found.append(
            f"when its {plan.names[index]} timer fires {plan.events[index]} at "
            f"t={deadline:.3f}, {when}"
        )
    return found

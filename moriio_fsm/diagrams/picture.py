"""What a spec's diagram shows, whatever draws it: boxes (states) and arrows (moves).

Rules: every row a diagram shows appears once per source state: a row that leaves the
state is a line on an arrow, a row that keeps it (internal, or back into the same state)
is a line inside that state's box. A row that leaves several states is one arrow with
several tails; rows into the same state from some of those tails join that arrow, saying
which. Rows that change nothing (outcome duplicate or ignored) are shown only when asked
for.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from ..lang.model import Spec, TransitionSpec
from .usage import Usage


@dataclass(frozen=True)
class Line:
    """One row as a reader sees it: ``event [guard] / effects (outcome) xN``."""

    event: str | None
    guard: str | None
    emits: tuple[str, ...]
    outcome: str
    timer: bool
    count: int | None = None
    #: The states it leaves from, when it shares an arrow with rows that leave from more.
    only_from: tuple[str, ...] = ()

    def head(self) -> str:
        """The trigger: the event, the guard that must hold (eventless: the guard alone),
        the states it applies in when not all the arrow's tails."""
        parts = [self.event] if self.event else []
        if self.guard:
            parts.append(f"[{self.guard}]")
        if self.only_from:
            parts.append(f"(in {', '.join(self.only_from)})")
        return " ".join(parts)

    def tail(self) -> str:
        """What happens besides the move: the effects, a non-applied outcome, the count."""
        parts = ["/ " + ", ".join(self.emits)] if self.emits else []
        if self.outcome != "applied":
            parts.append(f"({self.outcome})")
        if self.count is not None:
            parts.append(f"x{self.count}")
        return " ".join(parts)

    def text(self) -> str:
        return " ".join(part for part in (self.head(), self.tail()) if part)


@dataclass
class Box:
    """One state: what it is, the timers armed in it, the rows that keep it."""

    name: str
    final: bool
    anomaly: bool
    stuck: int
    timers: list[str] = field(default_factory=list)
    lines: list[Line] = field(default_factory=list)

    @property
    def kind(self) -> str:
        """What colours the box: ``stuck`` first, then ``anomaly``, ``final``, or ``""``."""
        if self.stuck:
            return "stuck"
        return "anomaly" if self.anomaly else "final" if self.final else ""

    @property
    def role(self) -> str:
        """``final``, ``final, anomaly``, ``N stuck``...: what the box's colour stands for."""
        words = ["final"] if self.final else []
        if self.anomaly:
            words.append("anomaly")
        if self.stuck:
            words.append(f"{self.stuck} stuck")
        return ", ".join(words)


@dataclass
class Arrow:
    """Rows that move from any of ``sources`` to ``dest``."""

    sources: tuple[str, ...]
    dest: str
    lines: list[Line] = field(default_factory=list)

    @property
    def timer_only(self) -> bool:
        return all(line.timer for line in self.lines)


@dataclass
class Picture:
    name: str
    spec_file: str
    initial: str
    boxes: dict[str, Box]
    arrows: list[Arrow]
    counted: bool = False  # lines carry a trace's counts
    all_rows: bool = False  # rows that change nothing are drawn too


def picture(
    spec: Spec, *, usage: Usage | None = None, all_rows: bool = False, shared_tails: bool = True
) -> Picture:
    """The boxes and arrows that draw ``spec`` (with ``usage``'s counts, if given). Without
    ``shared_tails`` every arrow has one tail: one arrow per pair of states."""
    boxes = {name: _box(spec, name, usage) for name in spec.states}
    arrows: dict[tuple[str, tuple[str, ...]], Arrow] = {}
    for row in spec.transitions:
        if row.outcome != "applied" and not all_rows:
            continue
        dest = row.dest
        leaving = tuple(s for s in row.sources if dest is not None and s != dest)
        for source in row.sources:
            if source not in leaving:
                boxes[source].lines.append(_line(spec, row, usage, (source,)))
        if dest is None or not leaving:
            continue
        for tails in [leaving] if shared_tails else [(s,) for s in leaving]:
            arrow = arrows.setdefault((dest, tails), Arrow(tails, dest))
            arrow.lines.append(_line(spec, row, usage, tails))
    kept = _fold(list(arrows.values())) if shared_tails else list(arrows.values())
    return Picture(
        spec.name,
        Path(spec.path).name,
        spec.initial,
        boxes,
        kept,
        counted=usage is not None,
        all_rows=all_rows,
    )


def _fold(arrows: list[Arrow]) -> list[Arrow]:
    """Fold an arrow into a wider one to the same state whose tails include all of its
    own, its lines saying which states they leave: two arrows between the same two states
    would lay their labels over each other."""
    kept: list[Arrow] = []
    for arrow in sorted(arrows, key=lambda a: -len(a.sources)):
        wider = next(
            (k for k in kept if k.dest == arrow.dest and set(arrow.sources) < set(k.sources)), None
        )
        if wider is None:
            kept.append(arrow)
        else:
            wider.lines += [replace(line, only_from=arrow.sources) for line in arrow.lines]
    return sorted(kept, key=arrows.index)


def _box(spec: Spec, name: str, usage: Usage | None) -> Box:
    state = spec.states[name]
    stuck = usage.stuck.get(name, 0) if usage is not None else 0
    timers = [f"{t.event} after {t.duration_key}" for t in spec.timers.values() if name in t.states]
    return Box(name, state.final, state.anomaly, stuck, timers)


def _line(spec: Spec, row: TransitionSpec, usage: Usage | None, sources: tuple[str, ...]) -> Line:
    count = None
    if usage is not None:
        taken: set = set()
        for source in sources:
            taken |= usage.edges.get((row.index, source), set())
        count = len(taken)
    timer = row.event is not None and spec.events[row.event].origin == "timer"
    return Line(row.event, row.guard, row.emits, row.outcome, timer, count)

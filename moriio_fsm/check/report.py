"""What a checking run says: one summary line per model, each broken rule with its shortest
counterexample as numbered steps, the same as JSON, and a progress bar on long runs.

Rules: results are returned as text or JSON for the caller to print; the progress bar
draws on stderr, only on a terminal and only once a run has taken more than a second;
nothing here changes a result.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

from ..runtime.events import Effect, Event
from .explore import Exploration, Finding
from .pair import WorldNote
from .single import Dispatch, TimePasses

if TYPE_CHECKING:
    from rich.progress import Progress, TaskID


def summary(result: Exploration) -> str:
    verdict = "ok" if result.ok else ("INCOMPLETE" if not result.complete else "FAILED")
    line = (
        f"{result.name}: {verdict}: {result.states:,} states, {result.transitions:,} "
        f"transitions, {result.ended:,} ended, {result.seconds:.1f} s"
    )
    if not result.complete:
        line += " (stopped at the state limit: raise --max-states or lower the bounds)"
    return line


def steps_of(path: list) -> list:
    """The flat list of steps of a counterexample (a pair's move holds several)."""
    flat: list = []
    for label in path:
        if isinstance(label, tuple) and not hasattr(label, "_fields"):
            flat.extend(label)
        elif label is not None:
            flat.append(label)
    return flat


def show_event(item: Event | Effect) -> str:
    """``kind(field=value, ...)`` for an event or an effect (just ``kind`` without fields)."""
    data = item.data
    args = ", ".join(f"{name}={value!r}" for name, value in data.items())
    return f"{item.kind}({args})" if data else item.kind


def show_step(step) -> str:
    if isinstance(step, TimePasses):
        return f"t={step.now:g}  time passes"
    if isinstance(step, WorldNote):
        return f"      {step.text}"
    if isinstance(step, Dispatch):
        ev, result = step.event, step.result
        head = f"t={ev.time:g}  {step.machine} <- {show_event(ev)}"
        if result is None:
            return head + ": RAISED (below)"
        outcome = result.outcome.value
        hops = (
            " -> ".join([result.hops[0][0]] + [h[1] for h in result.hops])
            if result.hops
            else result.state
        )
        effects = ", ".join(show_event(e) for e in result.effects)
        return f"{head}: {outcome}, {hops}" + (f"; emits {effects}" if effects else "")
    return str(step)


def render_finding(finding: Finding) -> list[str]:
    lines = [
        f"  broken: {finding.rule}: {finding.message}",
        f"  shortest counterexample ({len(steps_of(finding.path))} steps):",
    ]
    for number, step in enumerate(steps_of(finding.path), 1):
        lines.append(f"    {number:3d}. {show_step(step)}")
    return lines


def as_json(result: Exploration, traces: dict[str, str] | None = None) -> dict[str, Any]:
    return {
        "name": result.name,
        "ok": result.ok,
        "complete": result.complete,
        "states": result.states,
        "transitions": result.transitions,
        "ended": result.ended,
        "seconds": round(result.seconds, 3),
        "stuck": result.stuck,
        "findings": [
            {
                "rule": f.rule,
                "message": f.message,
                "steps": [show_step(s).strip() for s in steps_of(f.path)],
                "trace": (traces or {}).get(f.rule),
            }
            for f in result.findings.values()
        ],
    }


class ProgressBar:
    """A progress bar on stderr for runs that take more than ``after_s``, on a terminal
    only: explored states over states found (it fills as the queue empties), with the
    counts and the time. Use it as a context manager; call it as a search's progress."""

    def __init__(self, *, after_s: float = 1.0):
        self.after_s = after_s
        self._bar: Progress | None = None  # rich is imported when a bar is first shown
        self._task: TaskID | None = None
        self._enabled = sys.stderr.isatty()

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __call__(
        self, name: str, states: int, transitions: int, queued: int, seconds: float
    ) -> None:
        if not self._enabled or seconds < self.after_s:
            return
        if self._bar is None:
            from rich.console import Console
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

            self._bar = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                TextColumn("{task.fields[counts]}"),
                TimeElapsedColumn(),
                console=Console(stderr=True),
                transient=True,
            )
            self._bar.start()
        if self._task is None or self._bar.tasks[0].description != name:
            if self._task is not None:
                self._bar.remove_task(self._task)
            self._task = self._bar.add_task(name, total=1, counts="")
        self._bar.update(
            self._task,
            total=max(states, 1),
            completed=states - queued,
            counts=f"{states:,} states, {transitions:,} transitions",
        )

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
            self._task = None

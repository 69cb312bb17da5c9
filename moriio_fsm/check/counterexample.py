"""Counterexamples as trace files that ``moriio-fsm replay`` accepts and ``explain`` explains.

Rules: a counterexample's events are dispatched again, in order, to fresh check-mode
tables of the machines explored, each with a ``TraceRecorder`` of the side it stands for
(``docs/trace-format.md``), so the file holds exactly what those tables did, the broken
step included (recorded ``raised`` when check mode rolled it back). A machine whose
bindings were swapped for the search (a planted bug) is recorded with them; its replay
against the shipped bindings then shows where they differ.
"""

from __future__ import annotations

from pathlib import Path

from ..runtime.errors import InvariantViolation, TransitionError
from ..runtime.machine import Machine
from ..runtime.table import TransferTable
from ..trace import TraceRecorder, write_trace
from .explore import Finding
from .report import steps_of
from .single import Dispatch


def write_counterexample(
    path: str | Path, finding: Finding, sides: dict[str, tuple[str, Machine]]
) -> int:
    """Write ``finding``'s path as a trace at ``path``; ``sides`` maps the machine label
    of each ``Dispatch`` to (trace side, machine). Returns the number of steps written."""
    recorders: dict[str, TraceRecorder] = {}
    tables: dict[str, TransferTable] = {}
    order: list[str] = []
    for step in steps_of(finding.path):
        if not isinstance(step, Dispatch):
            continue
        side, machine = sides[step.machine]
        if side not in tables:
            recorders[side] = TraceRecorder(
                side, ring=1 << 20, per_transfer=1 << 20, transfers=4, ended=4, virtual_time=True
            )
            tables[side] = TransferTable(machine, check_invariants=True, recorder=recorders[side])
        try:
            tables[side].dispatch(step.event)
        except (InvariantViolation, TransitionError):
            pass  # recorded as raised, like the step the search saw
        order.append(side)
    by_side = {side: iter(recorder.records()) for side, recorder in recorders.items()}
    steps = [next(by_side[side]) for side in order]
    infos = [info for recorder in recorders.values() for info in recorder.tables()]
    write_trace(path, [*infos, *steps])
    return len(steps)

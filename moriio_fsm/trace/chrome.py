"""Export a trace in the Chrome trace event format, which Perfetto UI and chrome://tracing open.

Rules: one async track per transfer (``"b"``/``"e"`` with the transfer's ``id`` and
``cat``): a span for the transfer's whole life and, nested in it, one span per state it
was in; each step is an async instant (``"n"``) with its outcome, payload and effects.
Each side is a process (``"M"`` ``process_name``). Time is the wall clock in
microseconds (the step's ``t`` where a trace has none). Every ``"b"`` is closed by an
``"e"``: transfers still live when the trace ends are closed at its last timestamp.
The output is streamed, so memory grows with the live transfers, not the trace.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import TextIO

from .format import Step, TableInfo
from .reader import iter_records


def export_chrome(paths: Iterable[str | Path], out: TextIO) -> int:
    """Write ``{"traceEvents": [...]}`` for the trace files to ``out``; returns the number
    of trace events written."""
    writer = _ChromeWriter(out)
    out.write('{"displayTimeUnit":"ms","traceEvents":[\n')
    for path in paths:
        for _, record in iter_records(path):
            if isinstance(record, TableInfo):
                writer.tables[(record.side, record.table)] = record
            elif isinstance(record, Step):
                writer.step(record)
    writer.close_live()
    out.write("\n]}\n")
    return writer.count


class _ChromeWriter:
    """The export's state as it streams: a process per side, and the open spans of the
    transfers still live (their span id, category and current state)."""

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.pids: dict[str, int] = {}
        self.open_spans: dict[tuple, tuple[str, str, str]] = {}  # transfer key -> (id, cat, state)
        self.ids: dict[tuple, str] = {}
        self.tables: dict[tuple[str, str], TableInfo] = {}
        self.count = 0
        self.last_ts = 0.0

    def emit(self, event: dict) -> None:
        separator = ",\n" if self.count else ""
        self.out.write(separator + json.dumps(event, separators=(",", ":"), default=repr))
        self.count += 1

    def step(self, step: Step) -> None:
        """Draw one step: open its transfer's span if new, mark the step, move its state
        span, and close both spans when it reaches a final state."""
        pid = self._process(step.side)
        ts = round((step.wall if step.wall is not None else step.t) * 1e6, 3)
        self.last_ts = max(self.last_ts, ts)
        key = (step.side, step.table, step.transfer)
        base = {"pid": pid, "tid": 0, "ts": ts}
        span = self.open_spans.get(key)
        if span is None:
            if step.after is None:
                return  # an event for no transfer: nothing to draw it on
            span = self._open(key, step, base)
        span_id, cat, state = span
        self._instant(step, base, cat, span_id)
        if step.after is not None and step.after != state:
            self.emit({**base, "ph": "e", "name": state, "cat": cat, "id": span_id})
            self.emit({**base, "ph": "b", "name": step.after, "cat": cat, "id": span_id})
            self.open_spans[key] = (span_id, cat, step.after)
            state = step.after
        if step.after is not None and step.after in _finals_of(step, self.tables):
            self.emit({**base, "ph": "e", "name": state, "cat": cat, "id": span_id})
            self.emit({**base, "ph": "e", "name": step.transfer, "cat": cat, "id": span_id})
            del self.open_spans[key]

    def _process(self, side: str) -> int:
        """The side's process id, named by a metadata event the first time it is seen."""
        pid = self.pids.get(side)
        if pid is None:
            pid = self.pids[side] = len(self.pids) + 1
            self.emit(
                {"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": side}}
            )
        return pid

    def _open(self, key: tuple, step: Step, base: dict) -> tuple[str, str, str]:
        """Open the transfer's span and, in it, the span of its first state."""
        assert step.after is not None, "a span opens on a state"
        span_id = self.ids.setdefault(key, f"0x{len(self.ids) + 1:x}")
        cat = f"{step.side}/{step.table}"
        self.emit(
            {
                **base,
                "ph": "b",
                "name": step.transfer,
                "cat": cat,
                "id": span_id,
                "args": {"side": step.side, "table": step.table},
            }
        )
        self.emit({**base, "ph": "b", "name": step.after, "cat": cat, "id": span_id})
        span = self.open_spans[key] = (span_id, cat, step.after)
        return span

    def _instant(self, step: Step, base: dict, cat: str, span_id: str) -> None:
        self.emit(
            {
                **base,
                "ph": "n",
                "name": step.event,
                "cat": cat,
                "id": span_id,
                "args": {
                    "outcome": step.outcome,
                    "before": step.before,
                    "after": step.after,
                    "data": step.data,
                    "effects": step.effects,
                    "seq": step.seq,
                    **({"error": step.error} if step.error else {}),
                },
            }
        )

    def close_live(self) -> None:
        """Close the spans of transfers still live when the trace ends, at its last time."""
        for (side, _, transfer), (span_id, cat, state) in self.open_spans.items():
            base = {"pid": self.pids[side], "tid": 0, "ts": self.last_ts}
            self.emit({**base, "ph": "e", "name": state, "cat": cat, "id": span_id})
            self.emit(
                {
                    **base,
                    "ph": "e",
                    "name": transfer,
                    "cat": cat,
                    "id": span_id,
                    "args": {"note": "still live when the trace ends"},
                }
            )


_finals: dict[str, frozenset] = {}


def _finals_of(step: Step, tables: dict) -> frozenset:
    """The final states of the spec ``step``'s table runs (from its table line, or the
    shipped spec its table key names); empty when the spec cannot be found."""
    info = tables.get((step.side, step.table))
    source = (
        info.spec_path
        if info is not None and Path(info.spec_path).is_file()
        else (info.spec if info is not None else step.table.split("#")[0])
    )
    finals = _finals.get(source)
    if finals is None:
        from ..machines import load_machine_spec

        try:
            finals = frozenset(load_machine_spec(source).final_states)
        except Exception:  # an unknown spec: spans close at the end of the trace
            finals = frozenset()
        _finals[source] = finals
    return finals

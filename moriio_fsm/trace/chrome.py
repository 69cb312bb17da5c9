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
    pids: dict[str, int] = {}
    open_spans: dict[tuple, tuple[str, str, str]] = {}  # transfer key -> (id, cat, state)
    ids: dict[tuple, str] = {}
    tables: dict[tuple[str, str], TableInfo] = {}
    count = 0
    last_ts = 0.0
    first = True

    def emit(event: dict) -> None:
        nonlocal first, count
        out.write(("" if first else ",\n") + json.dumps(event, separators=(",", ":"), default=repr))
        first = False
        count += 1

    out.write('{"displayTimeUnit":"ms","traceEvents":[\n')
    for path in paths:
        for _, record in iter_records(path):
            if isinstance(record, TableInfo):
                tables[(record.side, record.table)] = record
            if not isinstance(record, Step):
                continue
            step = record
            pid = pids.get(step.side)
            if pid is None:
                pid = pids[step.side] = len(pids) + 1
                emit(
                    {
                        "name": "process_name",
                        "ph": "M",
                        "pid": pid,
                        "tid": 0,
                        "args": {"name": step.side},
                    }
                )
            ts = round((step.wall if step.wall is not None else step.t) * 1e6, 3)
            last_ts = max(last_ts, ts)
            key = (step.side, step.table, step.transfer)
            span = open_spans.get(key)
            base = {"pid": pid, "tid": 0, "ts": ts}
            if span is None:
                if step.after is None:
                    continue  # an event for no transfer: nothing to draw it on
                span_id = ids.setdefault(key, f"0x{len(ids) + 1:x}")
                cat = f"{step.side}/{step.table}"
                emit(
                    {
                        **base,
                        "ph": "b",
                        "name": step.transfer,
                        "cat": cat,
                        "id": span_id,
                        "args": {"side": step.side, "table": step.table},
                    }
                )
                emit({**base, "ph": "b", "name": step.after, "cat": cat, "id": span_id})
                span = open_spans[key] = (span_id, cat, step.after)
            span_id, cat, state = span
            emit(
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
            if step.after is not None and step.after != state:
                emit({**base, "ph": "e", "name": state, "cat": cat, "id": span_id})
                emit({**base, "ph": "b", "name": step.after, "cat": cat, "id": span_id})
                open_spans[key] = (span_id, cat, step.after)
                state = step.after
            if step.after is not None and step.after in _finals_of(step, tables):
                emit({**base, "ph": "e", "name": state, "cat": cat, "id": span_id})
                emit({**base, "ph": "e", "name": step.transfer, "cat": cat, "id": span_id})
                del open_spans[key]
    for (side, _, transfer), (span_id, cat, state) in open_spans.items():
        base = {"pid": pids[side], "tid": 0, "ts": last_ts}
        emit({**base, "ph": "e", "name": state, "cat": cat, "id": span_id})
        emit(
            {
                **base,
                "ph": "e",
                "name": transfer,
                "cat": cat,
                "id": span_id,
                "args": {"note": "still live when the trace ends"},
            }
        )
    out.write("\n]}\n")
    return count


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

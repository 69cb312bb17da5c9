"""What a trace says about one spec, for its diagram: transfers per row and source state,
and the states where transfers were left (not final) when the trace ends.

Rules: only the tables of the spec count (found by the trace's table records, or by a
table named after the spec); a row index the spec does not have is skipped.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from ..lang.model import Spec


@dataclass
class Usage:
    """Transfers per (row index, source state), and stuck transfers per state."""

    edges: dict[tuple[int, str], set] = field(default_factory=dict)
    stuck: dict[str, int] = field(default_factory=dict)


def usage_from_trace(paths: Iterable[str], spec: Spec) -> Usage:
    """Edge and stuck-state counts of ``spec``'s tables in trace files."""
    from ..trace.format import Step, TableInfo
    from ..trace.reader import iter_records

    usage = Usage()
    rows = {row.index: row for row in spec.transitions}
    last: dict[tuple, str | None] = {}
    for path in paths:
        tables: set[tuple[str, str]] = set()
        for _, record in iter_records(path):
            if isinstance(record, TableInfo):
                if record.spec == spec.name:
                    tables.add((record.side, record.table))
                continue
            if not isinstance(record, Step) or record.after is None:
                continue
            ours = (record.side, record.table) in tables or record.table.split("#")[0] == spec.name
            if not ours:
                continue
            key = (record.side, record.table, record.transfer)
            state = record.before if record.before is not None else spec.initial
            for index in record.rows or ():
                row = rows.get(index)
                if row is None:
                    continue
                usage.edges.setdefault((index, state), set()).add(key)
                if row.dest is not None:
                    state = row.dest
            last[key] = record.after
    final = set(spec.final_states)
    for left in last.values():
        if left is not None and left not in final:
            usage.stuck[left] = usage.stuck.get(left, 0) + 1
    return usage

"""Where a rank records its transfers: the trace recorder its settings ask for, and its files.

Rules: a flight recorder is on by default (``trace_ring_size``); files are named by a
template that may use ``{engine_id}``, ``{dp_rank}`` and ``{tp_rank}``, and a template that
names none of them gets the ranks appended when several ranks would otherwise share a file.
"""

from __future__ import annotations

from typing import Any

from .settings import ConnectorSettings
from .topology import Topology


def trace_path(template: str | None, engine_id: str, topology: Topology) -> str | None:
    """The file ``template`` names for this rank; None when there is no template."""
    if not template:
        return None
    dp, tp = topology.dp_rank, topology.tp_rank
    path = template.format(engine_id=engine_id, dp_rank=dp, tp_rank=tp)
    if path == template and (topology.tp_size > 1 or dp > 0):
        stem, dot, suffix = path.rpartition(".")
        path = f"{stem}-dp{dp}-tp{tp}{dot}{suffix}" if dot else f"{path}-dp{dp}-tp{tp}"
    return path


def make_recorder(settings: ConnectorSettings, engine_id: str, topology: Topology) -> Any:
    """The trace recorder the settings ask for (a flight recorder by default), or None."""
    file = trace_path(settings.trace_file, engine_id, topology)
    dump = trace_path(settings.trace_dump_file, engine_id, topology)
    if settings.trace_ring_size == 0 and file is None and dump is None:
        return None
    from ..trace import TraceRecorder  # only where a rank records

    return TraceRecorder(
        topology.label(engine_id), ring=max(settings.trace_ring_size, 1), file=file, dump=dump
    )

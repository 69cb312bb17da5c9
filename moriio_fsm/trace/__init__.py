"""Event traces: recording every dispatch, trace files, replay, diagnosis and export.

The names a program needs: ``TraceRecorder`` (give it to a table as ``recorder=``),
``TraceWriter``, ``write_trace`` / ``read_trace`` / ``iter_records`` and the record types
``Step``, ``TableInfo``, ``Header``, ``Gap`` (the format: ``docs/trace-format.md``),
``trace_events`` (run events through a fresh table and get its steps) and ``replay``.
"""

from .format import FORMAT, RAISED, VERSION, Gap, Header, Step, TableInfo
from .reader import Trace, TraceError, iter_records, read_trace
from .recorder import TraceRecorder, trace_events
from .replay import replay
from .writer import TraceWriter, write_trace

__all__ = [
    "FORMAT",
    "RAISED",
    "VERSION",
    "Gap",
    "Header",
    "Step",
    "TableInfo",
    "Trace",
    "TraceError",
    "TraceRecorder",
    "TraceWriter",
    "iter_records",
    "read_trace",
    "replay",
    "trace_events",
    "write_trace",
]

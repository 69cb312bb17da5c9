"""``moriio-fsm export-trace``: convert traces to Chrome trace JSON (Perfetto UI).

Write TRACE files as one Chrome trace event file: an async track per transfer, its states
as spans, its events as instants, one process per side. Exit 0 when written; 2 when a
trace cannot be read or the file cannot be written.
"""

from __future__ import annotations

import argparse
import os
import sys

from ._command import add_command


def _export(args: argparse.Namespace) -> int:
    from ..trace.chrome import export_chrome
    from ..trace.reader import TraceError
    from ._trace_args import fail

    partial = f"{args.output}.partial"
    try:
        with open(partial, "w", encoding="utf-8") as out:
            count = export_chrome(args.traces, out)
        os.replace(partial, args.output)
    except TraceError as exc:
        os.unlink(partial)
        return fail(str(exc))
    except OSError as exc:
        return fail(f"cannot write {args.output}: {exc.strerror or exc}")
    print(
        f"{args.output}: {count} trace events (open it in Perfetto UI or chrome://tracing)",
        file=sys.stderr,
    )
    return 0


def register(sub) -> None:
    p = add_command(sub, "export-trace", __doc__)
    p.add_argument("traces", nargs="+", metavar="TRACE")
    p.add_argument("-o", "--output", required=True, metavar="FILE.json")
    p.set_defaults(run=_export)

"""``moriio-fsm explain``: the timeline of one transfer across P and D, and why it is stuck.

Replay the steps of one transfer's request from TRACE files of every side and print its
timeline (time, side, event, state, effects) and why it is where it is. Exit 0 when every
transfer of the request ended, 1 when one is stuck (or the transfer is not in the trace),
2 on a bad trace.
"""

from __future__ import annotations

import argparse

from ._command import add_command
from ._trace_args import add_spec_option, fail, spec_overrides


def _explain(args: argparse.Namespace) -> int:
    from ..trace.explain import explain
    from ..trace.reader import TraceError

    try:
        found = explain(args.traces, args.transfer, specs=spec_overrides(args.spec))
    except (TraceError, ValueError) as exc:
        return fail(str(exc))
    print(found.render())
    if not found.found:
        return 1
    stuck = any(
        (s.side, s.table, s.transfer) in found.report.live for s in found.report.transfers.values()
    )
    return 1 if stuck or found.report.divergences else 0


def register(sub) -> None:
    p = add_command(sub, "explain", __doc__)
    p.add_argument("traces", nargs="+", metavar="TRACE")
    p.add_argument(
        "--transfer",
        required=True,
        metavar="ID",
        help="a transfer id (either side's) or the request's link key",
    )
    add_spec_option(p)
    p.set_defaults(run=_explain)

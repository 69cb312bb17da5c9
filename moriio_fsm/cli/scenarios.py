"""``moriio-fsm scenarios``: drive WRITE producer transfers through the runtime, no vLLM
needed.

Print each scenario's path through the states and the effects it emitted.
"""

from __future__ import annotations

import argparse
import sys

from ._command import add_command


def _scenarios(args: argparse.Namespace) -> int:
    from .. import scenarios

    recorder = None
    if args.trace:
        from ..trace import TraceRecorder

        try:
            recorder = TraceRecorder("scenarios", file=args.trace)
        except ValueError as exc:
            print(f"moriio-fsm: {exc}", file=sys.stderr)
            return 2
    try:
        print(scenarios.render(scenarios.run(recorder=recorder)))
    finally:
        if recorder is not None:
            recorder.close()
    writer = recorder.writer if recorder is not None else None  # it has one: file= was given
    if writer is not None:
        print(
            f"trace: {args.trace} ({writer.stats()['written']} steps; try "
            f"moriio-fsm replay {args.trace})",
            file=sys.stderr,
        )
    return 0


def register(sub) -> None:
    p = add_command(sub, "scenarios", __doc__)
    p.add_argument("--trace", metavar="FILE", help="also write the scenarios' trace to FILE")
    p.set_defaults(run=_scenarios)

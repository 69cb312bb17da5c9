"""``moriio-fsm demo``: drive WRITE producer transfers through the runtime and show their paths."""

from __future__ import annotations

import argparse
import sys


def _demo(args: argparse.Namespace) -> int:
    from .. import demo

    recorder = None
    if args.trace:
        from ..trace import TraceRecorder

        try:
            recorder = TraceRecorder("demo", file=args.trace)
        except ValueError as exc:
            print(f"moriio-fsm: {exc}", file=sys.stderr)
            return 2
    try:
        print(demo.render(demo.run(recorder=recorder)))
    finally:
        if recorder is not None:
            recorder.close()
    if recorder is not None:
        print(f"trace: {args.trace} ({recorder.writer.stats()['written']} steps; try "
              f"moriio-fsm replay {args.trace})", file=sys.stderr)
    return 0


def register(sub) -> None:
    p = sub.add_parser("demo", help="drive WRITE producer transfers through the runtime")
    p.add_argument("--trace", metavar="FILE", help="also write the demo's trace to FILE")
    p.set_defaults(run=_demo)

"""``moriio-fsm demo``: drive WRITE producer transfers through the runtime and show their paths."""

from __future__ import annotations

import argparse


def _demo(args: argparse.Namespace) -> int:
    from .. import demo

    print(demo.render(demo.run()))
    return 0


def register(sub) -> None:
    p = sub.add_parser("demo", help="drive WRITE producer transfers through the runtime")
    p.set_defaults(run=_demo)

"""``moriio-fsm validate``: load and check spec files; exit 1 on any problem.

Load each spec and check it and its Python bindings: one line per good spec on stdout,
every problem as file:line on stderr. Exit 1 when any spec is invalid, so it can gate CI.
"""

from __future__ import annotations

import argparse
import sys

from ..lang.errors import SpecError
from ._command import add_command


def _validate(args: argparse.Namespace) -> int:
    from ..lang.loader import load_spec
    from ..machines import MACHINE_MODULES, load_bindings

    failed = 0
    for path in args.specs:
        try:
            spec = load_spec(path)
            if spec.name in MACHINE_MODULES:
                load_bindings(spec).check(spec)
        except SpecError as exc:
            failed += 1
            for problem in exc.problems:
                print(problem, file=sys.stderr)
            continue
        print(
            f"{path}: ok ({spec.name}: {len(spec.states)} states, {len(spec.events)} events, "
            f"{len(spec.transitions)} transitions, {len(spec.timers)} timers, "
            f"{len(spec.invariants)} invariants)"
        )
    if failed:
        print(f"{failed} of {len(args.specs)} spec(s) invalid", file=sys.stderr)
    return 1 if failed else 0


def register(sub) -> None:
    p = add_command(sub, "validate", __doc__)
    p.add_argument("specs", nargs="+", metavar="SPEC")
    p.set_defaults(run=_validate)

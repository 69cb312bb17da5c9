"""The ``moriio-fsm`` command line: validate specs and run the demo.

Every subcommand prints what it found and exits non-zero when something is wrong,
so it can gate CI.
"""

from __future__ import annotations

import argparse
import sys

from .lang.errors import SpecError


def _validate(args: argparse.Namespace) -> int:
    from .machines import MACHINE_MODULES, load_bindings
    from .lang.loader import load_spec

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
        print(f"{path}: ok ({spec.name}: {len(spec.states)} states, {len(spec.events)} events, "
              f"{len(spec.transitions)} transitions, {len(spec.timers)} timers, "
              f"{len(spec.invariants)} invariants)")
    if failed:
        print(f"{failed} of {len(args.specs)} spec(s) invalid", file=sys.stderr)
    return 1 if failed else 0


def _demo(args: argparse.Namespace) -> int:
    from . import demo

    print(demo.render(demo.run()))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="moriio-fsm", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("validate", help="load and check spec files; exit 1 on any problem")
    p.add_argument("specs", nargs="+", metavar="SPEC")
    p.set_defaults(run=_validate)
    p = sub.add_parser("demo", help="drive WRITE producer transfers through the runtime")
    p.set_defaults(run=_demo)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())

"""The ``moriio-fsm`` command line: one module per subcommand, found by discovery.

Every module in this package that defines ``register(subparsers)`` adds one subcommand
whose handler returns the exit code (0: all good; 1: a problem found in the input;
2: the command was used wrongly). Heavy imports happen inside the handlers, so
``--help`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="moriio-fsm",
        description="KV-cache transfer lifecycles as checkable state machines: validate and "
        "draw specs, replay and explain traces, check models, run the demo.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        register = getattr(module, "register", None)
        if register is not None:
            register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())

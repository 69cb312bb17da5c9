"""``moriio-fsm diagram``: draw a spec (svg, png, dot or mermaid), optionally with a trace's usage.

Exit code 0 when drawn; 2 when the spec, the trace or the format cannot be used (the
message says what to install or pass instead).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _diagram(args: argparse.Namespace) -> int:
    from .. import diagrams
    from ..lang.errors import SpecError
    from ..machines import load_machine_spec
    from ..trace.reader import TraceError
    from ._trace_args import fail

    try:
        if args.docs:
            for path in diagrams.write_docs(args.docs):
                print(path)
            return 0
        if not args.spec:
            return fail("diagram needs a SPEC (a shipped name such as write_producer, or a "
                        "spec file), or --docs DIR")
        spec = load_machine_spec(args.spec)
        usage = diagrams.usage_from_trace(args.trace, spec) if args.trace else None
        fmt = args.format or _format_of(args.output)
        drawn = diagrams.render(spec, fmt, usage=usage, all_rows=args.all_rows)
    except SpecError as exc:
        return fail("\n".join(str(p) for p in exc.problems))
    except (TraceError, diagrams.DiagramError, OSError) as exc:
        return fail(str(exc))
    if args.output:
        Path(args.output).write_bytes(drawn)
        print(f"{args.output}: {spec.name} as {fmt}", file=sys.stderr)
    elif fmt == "png":
        return fail("png is binary: pass -o FILE.png")
    else:
        sys.stdout.write(drawn.decode())
    return 0


def _format_of(output: str | None) -> str:
    suffix = Path(output).suffix.lstrip(".") if output else ""
    return {"mmd": "mermaid", "md": "mermaid", "gv": "dot"}.get(suffix, suffix) or "mermaid"


def register(sub) -> None:
    p = sub.add_parser(
        "diagram", help="draw a spec's state diagram (svg, png, dot, mermaid)",
        description="Draw SPEC with pytransitions' GraphMachine: edges show event, guard and "
                    "emitted effects; final and anomaly states are marked. With --trace, each "
                    "edge says how many transfers took it and states where transfers were "
                    "left stuck are highlighted. svg/png need Graphviz (apt-get install "
                    "graphviz); mermaid needs nothing.")
    p.add_argument("spec", nargs="?", metavar="SPEC", help="shipped spec name or spec file")
    p.add_argument("-f", "--format", choices=("svg", "png", "dot", "mermaid"),
                   help="output format (default: from -o's suffix, else mermaid)")
    p.add_argument("-o", "--output", metavar="FILE", help="write here instead of stdout")
    p.add_argument("--trace", action="append", default=[], metavar="TRACE",
                   help="count each edge's transfers in this trace file (repeatable)")
    p.add_argument("--all-rows", action="store_true",
                   help="also draw rows that change nothing (duplicate, ignored)")
    p.add_argument("--docs", metavar="DIR",
                   help="regenerate every shipped spec's svg and mermaid in DIR and the README's "
                        "WRITE producer diagram")
    p.set_defaults(run=_diagram)

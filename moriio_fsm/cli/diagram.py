"""``moriio-fsm diagram``: draw a spec's state diagram (svg, png, dot, mermaid).

Draw SPEC top to bottom: an arrow per move, its lines saying event, guard and emitted
effects; inside a state, its timers and the rows that keep it; final and anomaly states
are marked. With --trace, each row says how many transfers took it and states where
transfers were left stuck are highlighted. --overview draws the four shipped machines in
one picture. svg/png need Graphviz (apt-get install graphviz); dot and mermaid need
nothing. Exit 0 when drawn; 2 when the spec, the trace or the format cannot be used (the
message says what to install or pass instead).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ._command import add_command


def _diagram(args: argparse.Namespace) -> int:
    from .. import diagrams
    from ..lang.errors import SpecError
    from ..trace.reader import TraceError
    from ._trace_args import fail

    if args.overview and (args.spec or args.trace or args.all_rows or args.docs):
        return fail(
            "--overview draws the four shipped machines: it takes no SPEC, --trace, "
            "--all-rows or --docs"
        )
    if not (args.spec or args.overview or args.docs):
        return fail(
            "diagram needs a SPEC (a shipped name such as write_producer, or a spec "
            "file), --overview or --docs DIR"
        )
    fmt = args.format or _format_of(args.output, "svg" if args.overview else "mermaid")
    if fmt == "png" and not args.output and not args.docs:
        return fail("png is binary: pass -o FILE.png")
    try:
        if args.docs:
            for path in diagrams.write_docs(args.docs):
                print(path)
            return 0
        what, drawn = _draw(args, fmt)
    except SpecError as exc:
        return fail("\n".join(str(p) for p in exc.problems))
    except (TraceError, diagrams.DiagramError, OSError) as exc:
        return fail(str(exc))
    if args.output:
        Path(args.output).write_bytes(drawn)
        print(f"{args.output}: {what} as {fmt}", file=sys.stderr)
    else:
        sys.stdout.write(drawn.decode())
    return 0


def _draw(args: argparse.Namespace, fmt: str) -> tuple[str, bytes]:
    """What was drawn (for the message) and the drawing."""
    from .. import diagrams
    from ..machines import load_machine_spec

    if args.overview:
        return "the four machines", diagrams.render_overview(fmt)
    spec = load_machine_spec(args.spec)
    usage = diagrams.usage_from_trace(args.trace, spec) if args.trace else None
    return spec.name, diagrams.render(spec, fmt, usage=usage, all_rows=args.all_rows)


def _format_of(output: str | None, default: str) -> str:
    suffix = Path(output).suffix.lstrip(".") if output else ""
    return {"mmd": "mermaid", "md": "mermaid", "gv": "dot"}.get(suffix, suffix) or default


def register(sub) -> None:
    p = add_command(sub, "diagram", __doc__)
    p.add_argument("spec", nargs="?", metavar="SPEC", help="shipped spec name or spec file")
    p.add_argument(
        "-f",
        "--format",
        choices=("svg", "png", "dot", "mermaid"),
        help="output format (default: from -o's suffix, else mermaid)",
    )
    p.add_argument("-o", "--output", metavar="FILE", help="write here instead of stdout")
    p.add_argument(
        "--trace",
        action="append",
        default=[],
        metavar="TRACE",
        help="count each edge's transfers in this trace file (repeatable)",
    )
    p.add_argument(
        "--all-rows",
        action="store_true",
        help="also draw rows that change nothing (duplicate, ignored)",
    )
    p.add_argument(
        "--overview",
        action="store_true",
        help="draw the four shipped machines (WRITE and READ, producer and "
        "consumer) in one picture (svg, png or dot; default svg)",
    )
    p.add_argument(
        "--docs",
        metavar="DIR",
        help="regenerate in DIR every shipped spec's svg, png and mermaid and the "
        "overview (machines.svg, machines.png), and the WRITE producer's "
        "diagram in docs/machines.md",
    )
    p.set_defaults(run=_diagram)

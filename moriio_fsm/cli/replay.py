"""``moriio-fsm replay``: re-execute traces through fresh machines and check every step.

Re-execute the recorded events of TRACE files (P's and D's, several ranks, rotated parts:
all merged) through fresh machines; check that every recorded state, effect and outcome
comes out again, and report the first divergence and every anomaly. Exit 0: clean
(everything reproduced, nothing anomalous); 1: diverged or anomalous; 2: a trace cannot
be read.
"""

from __future__ import annotations

import argparse
import json
import sys

from ._command import add_command
from ._trace_args import add_spec_option, fail, progress_for, spec_overrides

#: The executors a replay can run on (``moriio_fsm.trace.replay.EXECUTORS``; named here so
#: that ``--help`` imports nothing heavy).
EXECUTORS = ("compiled", "transitions")


#: The executor the fresh machines run on unless ``--executor`` names another.
DEFAULT_EXECUTOR = "compiled"


def _executor(args: argparse.Namespace) -> str:
    """``--executor``, or the old ``--engine`` (with a note that it was renamed);
    ``ValueError`` when both are given and disagree."""
    if args.renamed_engine is None:
        return args.executor or DEFAULT_EXECUTOR
    print(
        "moriio-fsm: replay --engine is renamed --executor (an engine is a transfer "
        "engine); --engine still works",
        file=sys.stderr,
    )
    if args.executor is not None and args.executor != args.renamed_engine:
        raise ValueError(
            f"--executor {args.executor} and --engine {args.renamed_engine} "
            "disagree; give --executor only"
        )
    return args.renamed_engine


def _replay(args: argparse.Namespace) -> int:
    from ..trace.reader import TraceError
    from ..trace.replay import replay

    try:
        executor = _executor(args)
        specs = spec_overrides(args.spec)
        with progress_for(args.traces) as progress:
            report = replay(
                args.traces,
                transfer=args.transfer,
                until=args.until,
                executor=executor,
                check_invariants=args.check_invariants,
                specs=specs,
                progress=progress,
            )
    except (TraceError, ValueError) as exc:
        return fail(str(exc))
    if args.json:
        print(json.dumps(as_json(report), indent=2, default=repr))
    else:
        print(render(report))
    return 0 if report.ok else 1


def as_json(report) -> dict:
    return {
        "ok": report.ok,
        "files": report.files,
        "executor": report.executor,
        "engine": report.executor,  # the key's old name, for scripts that read it
        "steps": report.steps,
        "compared": report.compared,
        "sides": report.sides,
        "divergences": [
            {
                "file": d.path,
                "line": d.line,
                "seq": d.step.seq,
                "side": d.step.side,
                "table": d.step.table,
                "transfer": d.step.transfer,
                "event": d.step.event,
                "t": d.step.t,
                "what": d.what,
                "recorded": d.recorded,
                "replayed": d.replayed,
                "context": d.context,
            }
            for d in report.divergences
        ],
        "anomalies": [
            {
                "kind": a.kind,
                "where": a.where,
                "transfer": a.transfer,
                "link": a.link,
                "message": a.message,
            }
            for a in report.anomalies
        ],
        "live": [
            {"side": side, "table": table, "transfer": tid, "state": tx.state}
            for (side, table, tid), tx in report.live.items()
        ],
        "notes": report.notes,
    }


def render(report) -> str:
    partial = sum(1 for s in report.transfers.values() if s.partial)
    lines = [
        f"replayed {report.compared:,} of {report.steps:,} steps, "
        f"{len(report.transfers):,} transfers on {len(report.sides)} side(s) "
        f"({', '.join(report.sides) or 'none'}) from {len(report.files)} file(s) with the "
        f"{report.executor} executor" + (f", until seq {report.until}" if report.until else "")
    ]
    if partial:
        lines.append(
            f"{partial} transfer(s) start mid-way in the trace (earlier steps rotated "
            "away or not kept) and were not replayed"
        )
    lines.extend(f"note: {note}" for note in report.notes)
    if report.divergences:
        first = report.divergences[0]
        lines.append("")
        lines.append(f"FIRST DIVERGENCE: {first.describe()}")
        if first.context:
            lines.append("  the transfer's steps before it:")
            lines.extend(f"    {c}" for c in first.context)
        lines.append(f"{len(report.divergences)} transfer(s) diverged")
    if report.until is not None and report.live:
        lines.append("")
        lines.append(f"live at seq {report.until}:")
        lines.extend(
            f"  {side}/{table} {tid!r} in {tx.state!r}"
            for (side, table, tid), tx in sorted(report.live.items())
        )
    if report.anomalies:
        lines.append("")
        lines.append(f"ANOMALIES ({len(report.anomalies)}):")
        lines.extend(f"  {a}" for a in report.anomalies)
    lines.append("")
    lines.append(
        "result: "
        + (
            "clean: every step reproduced, no anomaly"
            if report.ok
            else ", ".join(
                x
                for x in (
                    "diverged" if report.divergences else "",
                    "anomalies" if report.anomalies else "",
                )
                if x
            )
        )
    )
    return "\n".join(lines)


def register(sub) -> None:
    p = add_command(sub, "replay", __doc__)
    p.add_argument("traces", nargs="+", metavar="TRACE")
    p.add_argument("--transfer", metavar="ID", help="replay only this transfer's request")
    p.add_argument("--until", type=int, metavar="SEQ", help="stop each side after this seq")
    p.add_argument(
        "--executor",
        choices=EXECUTORS,
        default=None,
        help="what runs the fresh machines: compiled (generated steps, the "
        "default) or transitions (the reference semantics)",
    )
    # The option's old name: still accepted, not shown, noted on stderr when used.
    p.add_argument(
        "--engine", dest="renamed_engine", choices=EXECUTORS, default=None, help=argparse.SUPPRESS
    )
    p.add_argument(
        "--check-invariants",
        action="store_true",
        help="evaluate every spec invariant after every replayed step",
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    add_spec_option(p)
    p.set_defaults(run=_replay)

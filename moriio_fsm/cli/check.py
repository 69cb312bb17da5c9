"""``moriio-fsm check``: explore specs and P/D pairs exhaustively within bounds.

Explore every reachable (state, context) of each SPEC under every order of its events
within the bounds (duplicates, late events and timers included), running the real
bindings; check every invariant, that final states are absorbing, that a final state is
reachable without the peer, and the effect rules. SPEC is a shipped spec name, a .yaml
file, pair:write or pair:read (a producer and a consumer over a faulty channel), or all.
Prints one summary line per spec or pair (states, transitions, time), then every broken
rule with its shortest counterexample, written as a trace ``replay`` accepts. Exit 0:
every rule holds everywhere within the bounds; 1: something broke (or the state limit
stopped a run); 2: the command was used wrongly (a bad bound, spec or option).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from ._command import add_command
from ._trace_args import spec_overrides

#: What SPEC may also be: a pair of one mode, or everything shipped.
PAIRS = {"pair:write": "write", "pair:read": "read"}
ALL = "all"


def _fail(message: str) -> int:
    print(f"moriio-fsm check: {message}", file=sys.stderr)
    return 2


def _number(text: str):
    try:
        return int(text)
    except ValueError:
        return float(text)


def parse_configs(values: list[str]) -> dict[str, dict[str, float]]:
    """``MACHINE.KEY=VALUE`` options as {machine: {key: value}}; ``ValueError`` otherwise."""
    found: dict[str, dict[str, float]] = {}
    for value in values:
        match = re.fullmatch(r"([a-z_][a-z0-9_]*)\.([a-z_][a-z0-9_]*)=(.+)", value)
        if match is None:
            raise ValueError(
                f"--config takes MACHINE.KEY=VALUE (e.g. "
                f"write_producer.transfer_timeout_s=3), got {value!r}"
            )
        machine, key, number = match.groups()
        try:
            found.setdefault(machine, {})[key] = _number(number)
        except ValueError:
            raise ValueError(f"--config {value!r}: {number!r} is not a number") from None
    return found


def _tick(text: str):
    if text in ("auto", "off", "default"):
        return text
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, auto or off, got {text!r}") from None


def _targets(specs: list[str]) -> list[tuple[str, str]]:
    """(kind, what) per SPEC: ("spec", name or path) or ("pair", mode)."""
    from ..machines import MACHINE_MODULES

    targets: list[tuple[str, str]] = []
    for spec in specs:
        if spec == ALL:
            targets += [("spec", name) for name in MACHINE_MODULES]
            targets += [("pair", mode) for mode in PAIRS.values()]
        elif spec in PAIRS:
            targets.append(("pair", PAIRS[spec]))
        elif spec in MACHINE_MODULES or Path(spec).suffix in (".yaml", ".yml"):
            targets.append(("spec", spec))
        else:
            raise ValueError(
                f"unknown SPEC {spec!r}: expected a shipped spec "
                f"({', '.join(MACHINE_MODULES)}), a .yaml file, "
                f"{', '.join(PAIRS)} or {ALL}"
            )
    return targets


def _check(args: argparse.Namespace) -> int:
    from ..check import MODES, Bounds, CheckUsageError, check_pair, check_spec
    from ..check.counterexample import write_counterexample
    from ..check.report import ProgressBar, as_json, render_finding, summary
    from ..check.stepper import TRANSFER_ID
    from ..lang.errors import SpecError

    try:
        configs = parse_configs(args.config)
        specs = spec_overrides(args.spec)
        targets = _targets(args.specs)
        paired = {name for kind, what in targets if kind == "pair" for name in MODES[what]}
        stray = sorted(set(specs) - paired)
        if stray:
            raise ValueError(
                f"--spec {', '.join(stray)}: no pair checked here runs that machine "
                "(--spec applies to pair:write and pair:read; check a spec file "
                "alone by naming it)"
            )
        bounds = Bounds(
            layers=2 if args.layers is None else args.layers,
            writers=args.writers,
            peer_events=args.peer_events,
            faults=args.faults,
            tick_s=args.tick,
            max_states=args.max_states,
        )
        pair_bounds = bounds.with_(layers=1 if args.layers is None else args.layers)
    except (ValueError, CheckUsageError) as exc:
        return _fail(str(exc))
    out = Path(args.out)
    failed = False
    reports = []
    for kind, what in targets:
        try:
            with ProgressBar() as progress:
                if kind == "pair":
                    result = check_pair(
                        what,
                        pair_bounds,
                        configs=configs,
                        progress=progress,
                        specs={name: path for name, path in specs.items() if name in MODES[what]},
                    )
                else:
                    name = Path(what).stem if Path(what).suffix else what
                    result = check_spec(what, bounds, config=configs.get(name), progress=progress)
        except SpecError as exc:
            for problem in exc.problems:
                print(problem, file=sys.stderr)
            return 2
        except (ValueError, CheckUsageError) as exc:
            return _fail(f"{what}: {exc}")
        traces = {}
        for finding in result.findings.values():
            slug = re.sub(
                r"[^a-z0-9]+", "-", f"{result.name.split(' (')[0]}-{finding.rule}".lower()
            )
            path = out / f"counterexample-{slug.strip('-')}.jsonl"
            out.mkdir(parents=True, exist_ok=True)
            write_counterexample(path, finding, result.model.trace_sides())
            traces[finding.rule] = str(path)
        failed = failed or not result.ok
        if args.json:
            reports.append(as_json(result, traces))
            continue
        print(summary(result))
        for finding in result.findings.values():
            print("\n".join(render_finding(finding)))
            print(
                f"  trace: {traces[finding.rule]} (moriio-fsm replay {traces[finding.rule]}; "
                f"moriio-fsm explain --transfer {TRANSFER_ID} {traces[finding.rule]})"
            )
        sys.stdout.flush()
    if args.json:
        print(json.dumps(reports, indent=2))
    return 1 if failed else 0


def register(sub) -> None:
    p = add_command(sub, "check", __doc__)
    p.add_argument("specs", nargs="+", metavar="SPEC")
    p.add_argument(
        "--layers",
        type=int,
        default=None,
        metavar="N",
        help="layers per transfer (default 2 for one machine, 1 for a pair)",
    )
    p.add_argument(
        "--writers",
        type=int,
        default=1,
        metavar="N",
        help="ranks on the other side of one machine (default 1)",
    )
    p.add_argument(
        "--peer-events",
        type=int,
        default=4,
        metavar="N",
        help="events from the peer or adapters per run, one machine (default 4)",
    )
    p.add_argument(
        "--faults",
        type=int,
        default=1,
        metavar="N",
        help="faults per run of a pair: late or duplicated messages, failed "
        "operations and handlers (default 1; lost messages are free)",
    )
    p.add_argument(
        "--tick",
        type=_tick,
        default="default",
        metavar="SECONDS|auto|off",
        help="time steps between deadlines (default: off for one machine, auto, "
        "the common divisor of the timeouts, for pairs)",
    )
    p.add_argument(
        "--max-states",
        type=int,
        default=2_000_000,
        metavar="N",
        help="stop a run that finds more states (default 2,000,000)",
    )
    p.add_argument(
        "--config",
        action="append",
        default=[],
        metavar="MACHINE.KEY=VALUE",
        help="a timeout or limit of one machine, e.g. write_consumer.safety_timeout_s=90",
    )
    p.add_argument(
        "--spec",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="in a pair, run machine NAME from the spec file PATH",
    )
    p.add_argument(
        "--out",
        default=".",
        metavar="DIR",
        help="where counterexample traces are written (default: here)",
    )
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.set_defaults(run=_check)

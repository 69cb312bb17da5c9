"""Pieces the trace subcommands share: ``--spec NAME=PATH``, the progress bar, errors.

Rules: a bad trace or a bad option ends the command with exit code 2 and one line on
stderr that says what to do; only the command handlers print.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Callable, Iterator

#: Traces larger than this (bytes, all files together) get a progress bar on a terminal.
PROGRESS_FROM_BYTES = 8 << 20


def add_spec_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--spec",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="replay the table of spec NAME with the spec file PATH (when the "
        "trace's spec moved or changed)",
    )


def spec_overrides(values: list[str]) -> dict[str, str]:
    found = {}
    for value in values:
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise ValueError(
                f"--spec takes NAME=PATH (e.g. write_producer=specs/write_producer.yaml), "
                f"got {value!r}"
            )
        found[name] = path
    return found


def fail(message: str) -> int:
    print(f"moriio-fsm: {message}", file=sys.stderr)
    return 2


@contextlib.contextmanager
def progress_for(paths: list[str]) -> Iterator[Callable[[int], None] | None]:
    """A ``progress(steps)`` callback drawing a rich progress bar on stderr, for long
    traces on a terminal; None otherwise."""
    try:
        size = sum(os.path.getsize(p) for p in paths)
    except OSError:
        size = 0
    if size < PROGRESS_FROM_BYTES or not sys.stderr.isatty():
        yield None
        return
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    # Roughly 400 bytes per step line: the bar's total is an estimate, the count exact.
    with Progress(
        TextColumn("replaying"),
        BarColumn(),
        TextColumn("{task.completed:,} steps"),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        transient=True,
    ) as bar:
        task = bar.add_task("replay", total=max(1, size // 400))
        yield lambda steps: bar.update(task, completed=steps)

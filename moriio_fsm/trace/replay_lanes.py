"""The fresh tables a replay runs in: one lane per (side, table) of a trace, built as its
table line describes it, and the events rebuilt from the recorded steps.

Rules: a table line is input, so nothing of it reaches ``TransferTable`` unchecked
(``table_options``); a spec is taken from ``--spec``, the recorded path or the shipped
spec of that name, with a note when its digest changed; a step whose event or payload
its spec does not declare is a ``TraceError`` at its line.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path

from ..lang.errors import SpecError
from ..lang.shipped import SHIPPED_SPECS, spec_path
from ..runtime.events import Event
from ..runtime.table import EXECUTORS
from .facts import message_event, once_only_effects, remote_events
from .format import ReplayStep, TableInfo
from .reader import TraceError
from .replay_report import ReplayReport, TransferSummary
from .table_options import replay_config, replay_options

__all__ = [
    "EXECUTORS",
    "Lane",
    "ReplayError",
    "check_table_line",
    "event_builder",
    "new_lane",
    "spec_source",
]


class ReplayError(TraceError):
    """The trace is readable but cannot be replayed (a spec it names cannot be found...)."""

    def __init__(self, message: str, path: str = "", line: int = 0):
        super().__init__(path or "replay", line, message)


class _Probe:
    """The replay table's step recorder: keeps the last step's event, the state before
    it and the rows it took (its result and error reach the replay directly). A table
    records no malformed event, so ``ev`` tells whether this step was recorded."""

    def __init__(self) -> None:
        self.ev = None
        self.before: str | None = None
        self.rows: tuple | None = None

    def bind_table(self, table):
        probe = self

        def record(ev, before, result, rows, error=None):
            probe.ev = ev
            probe.before = before
            probe.rows = rows

        return record


class Lane:
    """One (side, table) of the trace and the fresh table its steps replay in."""

    def __init__(
        self,
        info: TableInfo,
        executor: str,
        check_invariants: bool,
        specs: dict[str, str],
        notes: list[str],
    ):
        from ..machines import build_table

        self.info = info
        self.probe = _Probe()
        source = spec_source(info, specs, notes)
        try:
            options = replay_options(info.options)
            if check_invariants:
                options["check_invariants"] = True
            self.table = build_table(
                source,
                executor=executor,
                config=replay_config(info.config),
                recorder=self.probe,
                **options,
            )
        except (SpecError, LookupError, ValueError, TypeError) as exc:
            raise ReplayError(
                f"cannot build table {info.table!r} of side {info.side!r} (spec "
                f"{info.spec!r}) as the trace describes it: {exc}"
            ) from None
        machine = self.table.machine
        self.spec = machine.spec
        self.events = machine.event_classes
        self.builders = {kind: event_builder(cls) for kind, cls in self.events.items()}
        self.actions = {i: row.action_names for i, row in machine.rows_by_index().items()}
        self.actions_cache: dict[tuple, list[str]] = {}  # rows -> their actions
        self.once = once_only_effects(self.spec)
        self.remote = remote_events(self.spec)
        self.messages = {
            kind: message_event(kind) for kind in self.spec.emits if message_event(kind)
        }
        self.noted = frozenset(self.once) | frozenset(self.messages)  # kinds the analysis needs
        self.last_seq = -1
        self.last_path, self.last_line = "", 0
        self.summaries: dict[str, TransferSummary] = {}
        self.diverged: set[str] = set()

    def actions_of(self, rows: tuple[int, ...]) -> list[str]:
        found = self.actions_cache.get(rows)
        if found is None:
            actions = self.actions
            found = self.actions_cache[rows] = [
                name for index in rows for name in actions.get(index, ())
            ]
        return found

    def summary_of(self, step: ReplayStep, report: ReplayReport, collect: bool) -> TransferSummary:
        """The summary of ``step``'s transfer, made at its first step (partial when that
        step is not its start: its earlier steps are not in the trace). A summary is
        never falsy, so the replay's loop looks it up itself first."""
        tid = step.transfer
        summary = self.summaries.get(tid)
        if summary is None:
            info = self.info
            summary = self.summaries[tid] = report.transfers[(info.side, info.table, tid)] = (
                TransferSummary(info.side, info.table, self.spec, tid, step.link_key, step.t)
            )
            summary.created_wall = summary.since_wall = step.t if step.wall is None else step.wall
            summary.partial = step.before is not None
            if collect:
                summary.steps, summary.lines = [], []
        return summary

    def event_of(self, step: ReplayStep, path: str, line: int):
        """The event ``step`` records, built again (by keyword when its payload is not
        exactly the declared one); ``TraceError`` when its spec does not declare it or
        its payload does not fit."""
        event = step.event
        build = self.builders.get(event)
        if build is None:
            raise TraceError(
                path,
                line,
                f"event {event!r} is not declared by spec "
                f"{self.spec.name!r} (table {self.info.table!r}); declared: "
                f"{', '.join(sorted(self.builders))}",
            )
        try:
            return build(step.transfer, step.t, step.data, step.source)
        except (KeyError, TypeError):
            try:
                return self.events[event](step.transfer, step.t, **step.data, source=step.source)
            except TypeError as exc:
                raise TraceError(
                    path,
                    line,
                    f"the payload of {event!r} does not fit its "
                    f"declaration in {self.spec.name!r}: {exc}",
                ) from None


def event_builder(cls: type[Event]) -> Callable:
    """``build(transfer_id, t, data, source)`` for event class ``cls``: its payload passed
    by position (keywords cost twice as much, and a replay builds one event per step).
    ``data`` of another size or with other names raises (KeyError or TypeError); the
    caller then builds by keyword, which names what does not fit."""
    fields = cls.__struct_fields__[2:-1]  # transfer_id, time, the payload..., source
    args = "".join(f"data[{name!r}], " for name in fields)
    source = (
        f"def build(tid, t, data, source):\n"
        f"    if len(data) != {len(fields)}:\n"
        f"        raise TypeError('payload size')\n"
        f"    return cls(tid, t, {args}source=source)\n"
    )
    namespace = {"cls": cls}
    exec(compile(source, f"<moriio-fsm event builder {cls.kind}>", "exec"), namespace)  # noqa: S102
    return namespace["build"]


def new_lane(
    side: str,
    table: str,
    infos: dict,
    executor: str,
    check_invariants: bool,
    specs: dict,
    report: ReplayReport,
) -> Lane:
    info = infos.get((side, table))
    if info is None:
        info = TableInfo(side, table, table.split("#")[0])
        report.notes.append(
            f"no table line for {table!r} of side {side!r}: replaying it with "
            "its shipped spec and defaults"
        )
    if side not in report.sides:
        report.sides.append(side)
    return Lane(info, executor, check_invariants, specs, report.notes)


def check_table_line(path: str, line: int, info: TableInfo) -> None:
    """Refuse, at its line, a table line whose options or config a replay does not build."""
    try:
        replay_options(info.options)
        replay_config(info.config)
    except ValueError as exc:
        raise TraceError(path, line, f"table {info.table!r} of side {info.side!r}: {exc}") from None


def _sha(path: Path) -> str:
    # Hashed in pieces: the path comes from the trace and may name a file of any size.
    try:
        with open(path, "rb") as handle:
            return hashlib.file_digest(handle, "sha256").hexdigest()
    except OSError:
        return ""


def spec_source(info: TableInfo, specs: dict[str, str], notes: list[str]) -> str:
    """The spec file to replay ``info`` with: one given on the command line, the recorded
    path, or the shipped spec of that name; a note when its digest differs."""
    if info.spec in specs:
        return specs[info.spec]
    candidates = []
    if info.spec_path:
        candidates.append(Path(info.spec_path))
    if info.spec in SHIPPED_SPECS:
        candidates.append(spec_path(info.spec))
    for path in candidates:
        if path.is_file() and (not info.spec_sha256 or _sha(path) == info.spec_sha256):
            return str(path)
    for path in candidates:
        if path.is_file():
            notes.append(
                f"spec {info.spec!r} changed since the trace was recorded (digest "
                f"{info.spec_sha256[:12]}, now {_sha(path)[:12]}): replaying with {path}, "
                "so divergences may come from the change"
            )
            return str(path)
    raise ReplayError(
        f"the spec {info.spec!r} the trace was recorded with is not at "
        f"{info.spec_path or '(no path recorded)'} and is not a shipped spec; pass "
        f"--spec {info.spec}=PATH"
    )

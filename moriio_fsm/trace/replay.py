"""Deterministic replay: a trace's events through fresh machines, every recorded result checked.

Theory of operation: each (side, table) of a trace gets a fresh ``TransferTable`` built
as the table line describes it (spec, config, options: ``replay_lanes.py``). Its steps
are re-dispatched in the order recorded (files of one writer in part order), and for
every step the state before, the outcome, the state after, the rows taken, their
actions and the effects must come out as recorded; the first difference of each
transfer is a divergence, and that transfer is not compared further (one cause,
reported once). Sides never share a table, so P's and D's traces replay independently;
what joins them is the analysis afterwards (``anomalies.py``). Timers are replayed as
the recorded timer events, so no clock is read. A transfer whose first record is not
its start (its earlier records were rotated away or fell out of a ring) cannot be
replayed and is listed as partial.

Rules: memory grows with the live transfers of the trace, never with its length, and a
table line cannot make it grow otherwise (``table_options`` bounds what it asks for);
``TraceError`` (file:line) for anything that makes the trace unreadable.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from msgspec.structs import asdict

from ..runtime.errors import InvariantViolation, TransitionError
from ..runtime.events import Outcome
from .format import RAISED, REPLAY_DECODER, Gap, Header, ReplayStep, Step, TableInfo
from .reader import TraceError, iter_records
from .render import effect_dict, same_effect
from .replay_lanes import EXECUTORS, Lane, ReplayError, check_table_line, new_lane
from .replay_report import Divergence, ReplayReport, TransferSummary

__all__ = [
    "EXECUTORS",
    "MAX_LIVE_TRANSFERS",
    "Divergence",
    "ReplayError",
    "ReplayReport",
    "TransferSummary",
    "links_of",
    "order_files",
    "replay",
]

#: An outcome's trace name by ``Outcome.index`` (``.value`` is a slow enum property).
_OUTCOME_NAMES = tuple(o.value for o in Outcome)
#: How many live transfers one replay may hold before it refuses the trace.
MAX_LIVE_TRANSFERS = 1_000_000


def order_files(paths: Iterable[str | Path]) -> list[str]:
    """The files in replay order: the parts of one writer oldest first (by part number),
    writers in the order their first file was given."""
    keyed = []
    for position, path in enumerate(paths):
        header = None
        for _, record in iter_records(path):
            header = record
            break
        assert isinstance(header, Header)
        keyed.append((header.writer or str(path), header.part, position, str(path)))
    first_seen: dict[str, int] = {}
    for writer, _, position, _ in keyed:
        first_seen.setdefault(writer, position)
    keyed.sort(key=lambda k: (first_seen[k[0]], k[1], k[2]))
    return [k[3] for k in keyed]


def links_of(paths: Iterable[str], transfer_id: str) -> set[str]:
    """Every link key of records whose transfer or link is ``transfer_id`` (a cheap
    first pass: only lines holding the id are decoded)."""
    links = {transfer_id}
    for path in paths:
        for _, record in iter_records(path, containing=(transfer_id,)):
            if isinstance(record, Step) and (
                record.transfer == transfer_id or record.link == transfer_id
            ):
                links.add(record.link_key)
    return links


def replay(
    paths: Iterable[str | Path],
    *,
    transfer: str | None = None,
    until: int | None = None,
    executor: str = "compiled",
    check_invariants: bool = False,
    specs: dict[str, str] | None = None,
    collect: bool = False,
    progress: Callable[[int], None] | None = None,
    max_live: int = MAX_LIVE_TRANSFERS,
) -> ReplayReport:
    """Replay trace files; see the module's theory of operation. ``transfer`` limits the
    replay to the transfers of that id's request (its link, on every side); ``until``
    stops each side after that seq; ``executor`` runs the fresh tables (``compiled`` or
    ``transitions``); ``collect`` keeps the steps of every transfer (for ``explain``);
    ``progress(n)`` is called with the number of steps read so far."""
    if executor not in EXECUTORS:
        raise ValueError(f"unknown executor {executor!r}; expected one of {', '.join(EXECUTORS)}")
    files = order_files(paths)
    run = _Run(
        ReplayReport(files=files, executor=executor, until=until),
        links_of(files, transfer) if transfer is not None else None,
        until,
        executor,
        check_invariants,
        dict(specs or {}),
        collect,
        progress,
        max_live,
    )
    for path in files:
        _replay_file(path, run)
    if progress is not None:
        progress(run.report.steps)
    _finish(run)
    return run.report


@dataclass
class _Run:
    """One replay: its report, its selection and options, and the lanes built so far."""

    report: ReplayReport
    wanted: set[str] | None
    until: int | None
    executor: str
    check_invariants: bool
    specs: dict[str, str]
    collect: bool
    progress: Callable[[int], None] | None
    max_live: int

    def __post_init__(self) -> None:
        self.lanes: dict[tuple[str, str], Lane] = {}
        self.infos: dict[tuple[str, str], TableInfo] = {}

    def lane(self, side: str, table: str, path: str) -> Lane:
        lane = self.lanes.get((side, table))
        if lane is None:
            lane = self.lanes[(side, table)] = new_lane(
                side,
                table,
                self.infos,
                self.executor,
                self.check_invariants,
                self.specs,
                self.report,
            )
        lane.last_path = path
        return lane

    def take(self, path: str, line: int, record) -> None:
        """A record that is not a step: a table line (checked, and never changed once
        its table replays) or a writer's gap."""
        if isinstance(record, TableInfo):
            key = (record.side, record.table)
            known = self.infos.get(key)
            if known is not None and known != record and key in self.lanes:
                raise TraceError(
                    path,
                    line,
                    f"table {record.table!r} of side "
                    f"{record.side!r} is described differently from before",
                )
            check_table_line(path, line, record)
            self.infos[key] = record
        elif isinstance(record, Gap):
            self.report.gaps.append(record)


def _finish(run: _Run) -> None:
    """After the last step: where each transfer and the traces end, what is still live,
    and the anomaly analysis."""
    from .anomalies import find_anomalies

    report = run.report
    for summary in report.transfers.values():
        if summary.last is not None:
            summary.last_t, summary.last_event = summary.last.t, summary.last.event
            wall = summary.last.t if summary.last.wall is None else summary.last.wall
            report.end_wall = max(report.end_wall, wall)
    for (side, table), lane in run.lanes.items():
        for tid in lane.table.live_ids():
            tx = lane.table.get(tid)
            if tx is not None:
                report.live[(side, table, tid)] = tx
    report.anomalies = find_anomalies(report)


def _replay_file(path: str, run: _Run) -> None:
    """The hot loop of a replay: one pass per step, what it touches held in locals; the
    common case (a step reproduced exactly) is tested inline (``_reproduced``)."""
    report, wanted, until, progress, collect = (
        run.report,
        run.wanted,
        run.until,
        run.progress,
        run.collect,
    )
    steps, compared = report.steps, report.compared
    lane = side = table_key = None
    checks = progress is not None or until is not None or wanted is not None
    for line, step in iter_records(path, containing=wanted, decoder=REPLAY_DECODER):
        if step.__class__ is not ReplayStep:
            run.take(path, line, step)
            continue
        steps += 1
        tid = step.transfer
        if checks:  # a progress bar or a filter: one test when neither
            if progress is not None and not steps & 0x3FFF:
                progress(steps)
            if until is not None and step.seq > until:
                continue
            if wanted is not None and tid not in wanted and step.link_key not in wanted:
                continue
        if step.side != side or step.table != table_key:  # steps come in runs per table
            side, table_key = step.side, step.table
            lane = run.lane(side, table_key, path)
            dispatch, probe, summaries = lane.table.dispatch, lane.probe, lane.summaries
            builders, remote, once, messages = lane.builders, lane.remote, lane.once, lane.messages
            noted = lane.noted
        if step.seq <= lane.last_seq:
            raise _out_of_order(path, line, step, lane)
        lane.last_seq = step.seq
        summary = summaries.get(tid) or lane.summary_of(step, report, collect)
        if collect:
            summary.steps.append(step)
            summary.lines.append((path, line))
        summary.note(step, remote, once, messages, noted)
        if summary.partial:
            continue
        try:
            ev = builders[step.event](tid, step.t, step.data, step.source)
        except (KeyError, TypeError):
            ev = lane.event_of(step, path, line)  # by keyword: names what does not fit
        error = None
        try:
            result = dispatch(ev)
        except (TransitionError, InvariantViolation) as exc:
            result, error = None, exc  # rolled back; the probe still saw the state before
        compared += 1
        if not compared & 0xFFF and len(lane.table) > run.max_live:
            raise TraceError(
                path,
                line,
                f"more than {run.max_live} transfers are live at once; "
                "a trace this wide is refused (pass a smaller --transfer selection)",
            )
        # A malformed event is refused before any transfer is looked up, and not recorded.
        before, rows = (probe.before, probe.rows) if probe.ev is ev else (None, None)
        if result is not None and _reproduced(lane, step, result, before, rows):
            continue
        if tid not in lane.diverged:
            _diverged(report, lane, path, line, step, (before, result, rows, error))
    report.steps, report.compared = steps, compared


def _reproduced(lane: Lane, step: ReplayStep, result, before, rows) -> bool:
    """The common case, tested first: the same states, outcome, rows, actions and
    effects (actions through the lane's cache; a miss takes ``_difference``)."""
    if not (
        before == step.before
        and result.state == step.after
        and _OUTCOME_NAMES[result.outcome.index] == step.outcome
        and (rows is None or step.rows is None or step.rows == rows)
        and (rows is None or step.actions is None or step.actions == lane.actions_cache.get(rows))
    ):
        return False
    recorded, produced = step.effects, result.effects
    if not recorded and not produced:
        return True
    if len(produced) == 1 == len(recorded):  # one effect: same_effect, inline
        effect = produced[0]
        fields = asdict(effect)
        if fields.pop("transfer_id") == step.transfer:
            fields["kind"] = effect.kind
            if fields == recorded[0]:
                return True
    return len(produced) == len(recorded) and all(
        same_effect(r, e, step.transfer) for r, e in zip(recorded, produced)
    )


def _diverged(
    report: ReplayReport, lane: Lane, path: str, line: int, step: ReplayStep, replayed: tuple
) -> None:
    """Record the transfer's first divergence (none when the slow comparison finds the
    step the same after all), with the transfer's earlier steps for the first one."""
    difference = _difference(lane, step, *replayed)
    if difference is None:
        return
    lane.diverged.add(step.transfer)
    what, recorded, found = difference
    report.divergences.append(Divergence(path, line, step, what, recorded, found))
    if len(report.divergences) == 1:
        report.divergences[0].context = _context(path, line, step)


def _out_of_order(path: str, line: int, step: ReplayStep, lane: Lane) -> TraceError:
    return TraceError(
        path,
        line,
        f"seq {step.seq} of side {step.side!r} table {step.table!r} "
        f"does not follow seq {lane.last_seq} (in {lane.last_path}): the files "
        "overlap (a dump and the full trace of one process?) or are out of order",
    )


def _difference(lane: Lane, step: ReplayStep, before, result, rows, error):
    if before != step.before:
        return "state before", step.before, before
    outcome = RAISED if result is None else _OUTCOME_NAMES[result.outcome.index]
    if outcome != step.outcome:
        if result is None:
            return "outcome", step.outcome, f"{RAISED} ({type(error).__name__}: {error})"
        return "outcome", step.outcome, outcome
    after = before if result is None else result.state
    if after != step.after:
        return "state after", step.after, after
    if step.rows is not None and rows is not None and tuple(step.rows) != rows:
        return "rows", list(step.rows), list(rows)
    if step.actions is not None and rows is not None and step.actions != lane.actions_of(rows):
        return "actions", step.actions, lane.actions_of(rows)
    recorded = step.effects
    produced = () if result is None else result.effects
    if len(recorded) != len(produced) or not all(
        same_effect(r, e, step.transfer) for r, e in zip(recorded, produced)
    ):
        return "effects", recorded, [effect_dict(e, step.transfer) for e in produced]
    if (
        result is None
        and step.error is not None
        and not step.error.startswith(type(error).__name__)
    ):
        return "error", step.error, f"{type(error).__name__}: {error}"
    return None


def _context(path: str, line: int, step: ReplayStep, keep: int = 5) -> list[str]:
    """The transfer's previous steps in the same file, as short lines."""
    earlier: deque = deque(maxlen=keep)
    for number, record in iter_records(path):
        if number >= line:
            break
        if (
            isinstance(record, Step)
            and record.transfer == step.transfer
            and record.side == step.side
            and record.table == step.table
        ):
            earlier.append(
                f"{path}:{number}: seq {record.seq} t={record.t:.6f} {record.event} "
                f"{record.outcome} {record.before} -> {record.after}"
            )
    return list(earlier)

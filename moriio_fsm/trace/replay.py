"""Deterministic replay: a trace's events through fresh machines, every recorded result checked.

Theory of operation: each (side, table) of a trace gets a fresh ``TransferTable`` built
as the table line describes it (spec, config, options). Its steps are re-dispatched in
the order recorded (files of one writer in part order), and for every step the state
before, the outcome, the state after, the rows taken, their actions and the effects
must come out as recorded; the first difference of each transfer is a divergence, and
that transfer is not compared further (one cause, reported once). Sides never share a
table, so P's and D's traces replay independently; what joins them is the analysis
afterwards (``anomalies.py``). Timers are replayed as the recorded timer events, so no
clock is read. A transfer whose first record is not its start (its earlier records
were rotated away or fell out of a ring) cannot be replayed and is listed as partial.

Rules: memory grows with the live transfers of the trace, never with its length, and a
table line cannot make it grow otherwise (``table_options`` bounds what it asks for);
``TraceError`` (file:line) for anything that makes the trace unreadable.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

from ..lang.errors import SpecError
from ..runtime.errors import InvariantViolation, TransitionError
from ..runtime.events import Outcome
from .facts import message_event, once_only_effects, remote_events
from .format import RAISED, REPLAY_DECODER, Gap, Header, ReplayStep, Step, TableInfo
from .reader import TraceError, iter_records, printable
from .table_options import replay_config, replay_options
from msgspec.structs import asdict

from .render import effect_dict, same_effect

ENGINES = ("compiled", "transitions")
#: An outcome's trace name by ``Outcome.index`` (``.value`` is a slow enum property).
_OUTCOME_NAMES = tuple(o.value for o in Outcome)
#: How many live transfers one replay may hold before it refuses the trace.
MAX_LIVE_TRANSFERS = 1_000_000


@dataclass
class Divergence:
    """The first step of one transfer whose replay differs from the record."""

    path: str
    line: int
    step: ReplayStep
    what: str
    recorded: Any
    replayed: Any
    context: list[str] = field(default_factory=list)

    def describe(self) -> str:
        s = self.step
        return (f"{self.path}:{self.line}: side {s.side}, table {s.table}, seq {s.seq}, transfer "
                f"{s.transfer!r}, event {s.event} at t={s.t:.6f}: recorded {self.what} "
                f"{self.recorded!r}, the replay gives {self.replayed!r}")


class TransferSummary:
    """What the analysis needs of one transfer of one side, kept while replaying."""

    __slots__ = ("side", "table", "spec", "transfer", "link", "created", "since", "since_wall",
                 "created_wall", "last", "last_t",
                 "last_event", "state", "rejected", "once", "sends", "arrivals", "raised",
                 "partial", "steps", "lines")

    def __init__(self, side: str, table: str, spec, transfer: str, link: str, t: float):
        self.side, self.table, self.spec, self.transfer, self.link = side, table, spec, transfer, link
        self.created = self.since = self.last_t = t
        self.created_wall = self.since_wall = t
        self.last: ReplayStep | None = None                       # the transfer's latest step
        self.last_event = ""
        self.state: str | None = None
        self.rejected: list[tuple[float, str, str | None]] = []
        self.once: dict[str, list[float]] = {}
        self.sends: list[tuple[str, float]] = []            # (event the peer gets, t)
        self.arrivals: list[tuple[str, float, str]] = []    # (event, t, source)
        self.raised: list[tuple[float, str, str]] = []      # (t, event, error)
        self.partial = False
        self.steps: list[ReplayStep] | None = None                # collected (explain)
        self.lines: list[tuple[str, int]] | None = None

    @property
    def who(self) -> str:
        return f"{printable(self.side)}/{printable(self.table)} {self.transfer!r}"


@dataclass
class ReplayReport:
    """Everything one replay found; ``ok`` when nothing diverged and nothing is anomalous."""

    files: list[str]
    engine: str
    steps: int = 0
    compared: int = 0
    divergences: list[Divergence] = field(default_factory=list)
    transfers: dict[tuple[str, str, str], TransferSummary] = field(default_factory=dict)
    live: dict[tuple[str, str, str], Any] = field(default_factory=dict)   # final records
    anomalies: list[Any] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    gaps: list[Gap] = field(default_factory=list)
    sides: list[str] = field(default_factory=list)
    until: int | None = None
    #: The latest wall clock (or ``t`` where a step has none) of any step: where the
    #: traces end, comparable across sides.
    end_wall: float = float("-inf")

    @property
    def ok(self) -> bool:
        return not self.divergences and not self.anomalies

    @property
    def first_divergence(self) -> Divergence | None:
        return self.divergences[0] if self.divergences else None


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


class _Lane:
    """One (side, table) of the trace and the fresh table its steps replay in."""

    def __init__(self, info: TableInfo, engine: str, check_invariants: bool,
                 specs: dict[str, str], notes: list[str]):
        from ..machines import build_table

        self.info = info
        self.probe = _Probe()
        source = _spec_source(info, specs, notes)
        try:
            options = replay_options(info.options)
            if check_invariants:
                options["check_invariants"] = True
            self.table = build_table(source, executor=engine, config=replay_config(info.config),
                                     recorder=self.probe, **options)
        except (SpecError, LookupError, ValueError, TypeError) as exc:
            raise ReplayError(f"cannot build table {info.table!r} of side {info.side!r} (spec "
                              f"{info.spec!r}) as the trace describes it: {exc}") from None
        machine = self.table.machine
        self.spec = machine.spec
        self.events = machine.event_classes
        self.builders = {kind: event_builder(cls) for kind, cls in self.events.items()}
        self.actions = {i: row.action_names for i, row in machine.rows_by_index().items()}
        self.actions_cache: dict[tuple, list[str]] = {}    # rows -> their actions
        self.rows_known = engine == "compiled"
        self.once = once_only_effects(self.spec)
        self.remote = remote_events(self.spec)
        self.messages = {kind: message_event(kind) for kind in self.spec.emits
                         if message_event(kind)}
        self.noted = frozenset(self.once) | frozenset(self.messages)   # kinds the analysis needs
        self.last_seq = -1
        self.last_path, self.last_line = "", 0
        self.summaries: dict[str, TransferSummary] = {}
        self.end_wall = float("-inf")
        self.diverged: set[str] = set()

    def actions_of(self, rows: tuple[int, ...]) -> list[str]:
        found = self.actions_cache.get(rows)
        if found is None:
            actions = self.actions
            found = self.actions_cache[rows] = [name for index in rows
                                                for name in actions.get(index, ())]
        return found


def event_builder(cls: type) -> Callable:
    """``build(transfer_id, t, data, source)`` for event class ``cls``: its payload passed
    by position (keywords cost twice as much, and a replay builds one event per step).
    ``data`` of another size or with other names raises (KeyError or TypeError); the
    caller then builds by keyword, which names what does not fit."""
    fields = cls.__struct_fields__[2:-1]      # transfer_id, time, the payload..., source
    args = "".join(f"data[{name!r}], " for name in fields)
    source = (f"def build(tid, t, data, source):\n"
              f"    if len(data) != {len(fields)}:\n"
              f"        raise TypeError('payload size')\n"
              f"    return cls(tid, t, {args}source=source)\n")
    namespace = {"cls": cls}
    exec(compile(source, f"<moriio-fsm event builder {cls.kind}>", "exec"), namespace)  # noqa: S102
    return namespace["build"]


class ReplayError(TraceError):
    """The trace is readable but cannot be replayed (a spec it names cannot be found...)."""

    def __init__(self, message: str, path: str = "", line: int = 0):
        super().__init__(path or "replay", line, message)


def _sha(path: Path) -> str:
    # Hashed in pieces: the path comes from the trace and may name a file of any size.
    try:
        with open(path, "rb") as handle:
            return hashlib.file_digest(handle, "sha256").hexdigest()
    except OSError:
        return ""


def _spec_source(info: TableInfo, specs: dict[str, str], notes: list[str]) -> str:
    """The spec file to replay ``info`` with: one given on the command line, the recorded
    path, or the shipped spec of that name; a note when its digest differs."""
    from ..machines import MACHINE_MODULES, spec_path

    if info.spec in specs:
        return specs[info.spec]
    candidates = []
    if info.spec_path:
        candidates.append(Path(info.spec_path))
    if info.spec in MACHINE_MODULES:
        candidates.append(spec_path(info.spec))
    for path in candidates:
        if path.is_file() and (not info.spec_sha256 or _sha(path) == info.spec_sha256):
            return str(path)
    for path in candidates:
        if path.is_file():
            notes.append(f"spec {info.spec!r} changed since the trace was recorded (digest "
                         f"{info.spec_sha256[:12]}, now {_sha(path)[:12]}): replaying with {path}, "
                         "so divergences may come from the change")
            return str(path)
    raise ReplayError(f"the spec {info.spec!r} the trace was recorded with is not at "
                      f"{info.spec_path or '(no path recorded)'} and is not a shipped spec; pass "
                      f"--spec {info.spec}=PATH")


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
            if isinstance(record, Step) and (record.transfer == transfer_id
                                             or record.link == transfer_id):
                links.add(record.link_key)
    return links


def replay(paths: Iterable[str | Path], *, transfer: str | None = None, until: int | None = None,
           engine: str = "compiled", check_invariants: bool = False,
           specs: dict[str, str] | None = None, collect: bool = False,
           progress: Callable[[int], None] | None = None,
           max_live: int = MAX_LIVE_TRANSFERS) -> ReplayReport:
    """Replay trace files; see the module's theory of operation. ``transfer`` limits the
    replay to the transfers of that id's request (its link, on every side); ``until``
    stops each side after that seq; ``collect`` keeps the steps of every transfer (for
    ``explain``); ``progress(n)`` is called with the number of steps read so far."""
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}; expected one of {', '.join(ENGINES)}")
    files = order_files(paths)
    report = ReplayReport(files=files, engine=engine, until=until)
    wanted = links_of(files, transfer) if transfer is not None else None
    lanes: dict[tuple[str, str], _Lane] = {}
    infos: dict[tuple[str, str], TableInfo] = {}
    specs = dict(specs or {})
    for path in files:
        _replay_file(path, report, lanes, infos, specs, wanted, until, engine, check_invariants,
                     collect, progress, max_live)
    if progress is not None:
        progress(report.steps)
    for summary in report.transfers.values():
        if summary.last is not None:
            summary.last_t, summary.last_event = summary.last.t, summary.last.event
            wall = summary.last.t if summary.last.wall is None else summary.last.wall
            report.end_wall = max(report.end_wall, wall)
    for lane_key, lane in lanes.items():
        for tid in lane.table.live_ids():
            tx = lane.table.get(tid)
            if tx is not None:
                report.live[(lane_key[0], lane_key[1], tid)] = tx
    from .anomalies import find_anomalies

    report.anomalies = find_anomalies(report)
    return report


def _replay_file(path: str, report: ReplayReport, lanes: dict, infos: dict, specs: dict,
                 wanted: set | None, until: int | None, engine: str, check_invariants: bool,
                 collect: bool, progress, max_live: int) -> None:
    """The hot loop of a replay: one pass per step, everything it touches a local, the
    transfer's summary kept inline (a call per step would cost as much as the step)."""
    summaries = report.transfers
    steps, compared = report.steps, report.compared
    lane = None
    side = table_key = None
    outcome_names = _OUTCOME_NAMES
    checks = progress is not None or until is not None or wanted is not None
    for line, record in iter_records(path, containing=wanted, decoder=REPLAY_DECODER):
        if record.__class__ is not ReplayStep:
            if isinstance(record, TableInfo):
                key = (record.side, record.table)
                known = infos.get(key)
                if known is not None and known != record and key in lanes:
                    raise TraceError(path, line, f"table {record.table!r} of side "
                                     f"{record.side!r} is described differently from before")
                _check_table_line(path, line, record)
                infos[key] = record
            elif isinstance(record, Gap):
                report.gaps.append(record)
            continue
        step: ReplayStep = record
        steps += 1
        tid = step.transfer
        if checks:                       # a progress bar or a filter: one test when neither
            if progress is not None and not steps & 0x3FFF:
                progress(steps)
            if until is not None and step.seq > until:
                continue
            if wanted is not None and tid not in wanted and step.link_key not in wanted:
                continue
        if step.side != side or step.table != table_key:     # steps come in runs per table
            side, table_key = step.side, step.table
            lane = lanes.get((side, table_key))
            if lane is None:
                lane = lanes[(side, table_key)] = _new_lane(side, table_key, infos, engine,
                                                             check_invariants, specs, report)
            lane.last_path = path
            builders, remote, noted, probe = lane.builders, lane.remote, lane.noted, lane.probe
            actions_cached = lane.actions_cache.get
            dispatch, lane_summaries, diverged = lane.table.dispatch, lane.summaries, lane.diverged
        seq = step.seq
        if seq <= lane.last_seq:
            raise TraceError(path, line, f"seq {seq} of side {side!r} table {table_key!r} "
                             f"does not follow seq {lane.last_seq} (in {lane.last_path}): the "
                             "files overlap (a dump and the full trace of one process?) or are "
                             "out of order")
        lane.last_seq = seq
        # -- the transfer's summary (what the anomaly analysis needs) ----------------------
        summary = lane_summaries.get(tid)
        if summary is None:
            summary = lane_summaries[tid] = summaries[(side, table_key, tid)] = \
                TransferSummary(side, table_key, lane.spec, tid, step.link_key, step.t)
            summary.created_wall = summary.since_wall = step.t if step.wall is None else step.wall
            summary.partial = step.before is not None
            if collect:
                summary.steps, summary.lines = [], []
        if collect:
            summary.steps.append(step)
            summary.lines.append((path, line))
        summary.last = step
        after = step.after
        if after != summary.state:
            summary.since = step.t
            summary.since_wall = step.t if step.wall is None else step.wall
            summary.state = after
        outcome = step.outcome
        if outcome == "rejected":
            summary.rejected.append((step.t, step.event, step.before))
        elif outcome == RAISED:
            summary.raised.append((step.t, step.event, step.error or ""))
        event = step.event
        if event in remote:
            summary.arrivals.append((event, step.t, step.source))
        recorded_effects = step.effects
        if recorded_effects and (len(recorded_effects) > 1
                                 or recorded_effects[0].get("kind") in noted):
            _note_effects(lane, summary, step)
        if summary.partial:
            continue
        # -- the step again, through the fresh table ---------------------------------------
        build = builders.get(event)
        if build is None:
            raise TraceError(path, line, f"event {event!r} is not declared by spec "
                             f"{lane.spec.name!r} (table {table_key!r}); declared: "
                             f"{', '.join(sorted(builders))}")
        try:
            ev = build(tid, step.t, step.data, step.source)
        except (KeyError, TypeError):
            try:
                ev = lane.events[event](tid, step.t, **step.data, source=step.source)
            except TypeError as exc:
                raise TraceError(path, line, f"the payload of {event!r} does not fit its "
                                 f"declaration in {lane.spec.name!r}: {exc}") from None
        error = None
        try:
            result = dispatch(ev)
        except (TransitionError, InvariantViolation) as exc:
            result, error = None, exc    # rolled back; the probe still saw the state before
        compared += 1
        if not compared & 0xFFF and len(lane.table) > max_live:
            raise TraceError(path, line, f"more than {max_live} transfers are live at once; a "
                             "trace this wide is refused (pass a smaller --transfer selection)")
        if probe.ev is ev:
            before, rows = probe.before, probe.rows
        else:                            # malformed: refused before any transfer was looked up
            before, rows = None, None
        # The common case, tested at once: same states, outcome, rows, actions and effects
        # (actions through the cache of actions_of; a miss takes the slow way below).
        if (result is not None and before == step.before and result.state == after
                and outcome_names[result.outcome.index] == outcome
                and (rows is None or step.rows is None or step.rows == rows)
                and (rows is None or step.actions is None or step.actions == actions_cached(rows))):
            produced = result.effects
            if not recorded_effects and not produced:
                continue
            if len(produced) == 1 == len(recorded_effects):    # one effect: same_effect inline
                effect = produced[0]
                fields = asdict(effect)
                if fields.pop("transfer_id") == tid:
                    fields["kind"] = effect.kind
                    if fields == recorded_effects[0]:
                        continue
            if len(produced) == len(recorded_effects):
                for recorded, effect in zip(recorded_effects, produced):
                    if not same_effect(recorded, effect, tid):
                        break
                else:
                    continue
        if tid in diverged:
            continue
        difference = _difference(lane, step, before, result, rows, error)
        if difference is not None:
            diverged.add(tid)
            what, recorded, replayed = difference
            report.divergences.append(Divergence(path, line, step, what, recorded, replayed))
            if len(report.divergences) == 1:
                report.divergences[0].context = _context(path, line, step)
    report.steps, report.compared = steps, compared


def _check_table_line(path: str, line: int, info: TableInfo) -> None:
    """Refuse, at its line, a table line whose options or config a replay does not build."""
    try:
        replay_options(info.options)
        replay_config(info.config)
    except ValueError as exc:
        raise TraceError(path, line, f"table {info.table!r} of side {info.side!r}: "
                         f"{exc}") from None


def _new_lane(side: str, table: str, infos: dict, engine: str, check_invariants: bool,
              specs: dict, report: ReplayReport) -> _Lane:
    info = infos.get((side, table))
    if info is None:
        info = TableInfo(side, table, table.split("#")[0])
        report.notes.append(f"no table line for {table!r} of side {side!r}: replaying it with "
                            "its shipped spec and defaults")
    if side not in report.sides:
        report.sides.append(side)
    return _Lane(info, engine, check_invariants, specs, report.notes)


def _note_effects(lane: _Lane, summary: TransferSummary, step: ReplayStep) -> None:
    # One row may emit several effects of a kind (one per layer): the once-only rule and
    # the messages count the steps that emitted a kind, not its instances.
    for kind in dict.fromkeys(effect.get("kind") for effect in step.effects):
        if kind in lane.once:
            summary.once.setdefault(kind, []).append(step.t)
        peer_event = lane.messages.get(kind)
        if peer_event is not None:
            summary.sends.append((peer_event, step.t))


def _difference(lane: _Lane, step: ReplayStep, before, result, rows, error):
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
            same_effect(r, e, step.transfer) for r, e in zip(recorded, produced)):
        return "effects", recorded, [effect_dict(e, step.transfer) for e in produced]
    if result is None and step.error is not None and not step.error.startswith(type(error).__name__):
        return "error", step.error, f"{type(error).__name__}: {error}"
    return None


def _context(path: str, line: int, step: ReplayStep, keep: int = 5) -> list[str]:
    """The transfer's previous steps in the same file, as short lines."""
    from collections import deque

    earlier: deque = deque(maxlen=keep)
    for number, record in iter_records(path):
        if number >= line:
            break
        if (isinstance(record, Step) and record.transfer == step.transfer
                and record.side == step.side and record.table == step.table):
            earlier.append(f"{path}:{number}: seq {record.seq} t={record.t:.6f} {record.event} "
                           f"{record.outcome} {record.before} -> {record.after}")
    return list(earlier)

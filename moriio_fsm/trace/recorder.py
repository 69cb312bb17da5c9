"""The trace recorder: one record per dispatch, into a flight recorder and optional files.

Rules: ``TraceRecorder`` is a step recorder (``TransferTable`` calls ``bind_table`` and
then the returned ``record`` under the shard lock after every step). On the dispatching
thread a record is one tuple of references (event, result and effects are immutable)
appended to bounded rings: the last ``ring`` records of every table, and the last
``per_transfer`` records of each transfer (live ones, and the ``ended`` most recently
ended). Nothing is rendered, formatted or written there: a ``TraceWriter`` (``file=``)
renders and writes on its own thread, and ``dump=`` gets the records of each transfer
that ends in a dump state (an anomaly state, ``failed`` or ``expired``, or after a step
that raised), at the moment it ends. A recorder never dispatches.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import socket
import threading
import time
import weakref
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from ..runtime.events import Outcome
from .format import Step, TableInfo
from .render import Processor, StepRenderer, register_table
from .writer import TraceWriter, write_trace

#: Final states whose transfers are dumped besides the spec's anomaly states.
DUMP_FINAL_STATES = frozenset({"failed", "expired"})

_CREATED = Outcome.CREATED


def _digest(path: str) -> str:
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError:
        return ""


class TableMeta:
    """What a record of one traced table needs to be rendered (kept for the process's
    life in ``render.TABLES``, so it holds no records)."""

    def __init__(self, recorder: TraceRecorder, table: Any, key: str):
        machine = table.machine
        spec = machine.spec
        self.side = recorder.side
        self.key = key
        self.spec = spec
        self.info = TableInfo(
            recorder.side,
            key,
            spec.name,
            spec_path=str(spec.path),
            spec_sha256=_digest(spec.path),
            executor=table.executor,
            config=dict(machine.config),
            options=dict(table.options),
        )
        self._actions = {index: row.action_names for index, row in machine.rows_by_index().items()}
        self.link = recorder.link
        # Numbers, not the recorder: this object lives as long as the process.
        self._wall0, self._mono0 = recorder._wall0, recorder._mono0
        self.final = machine.final
        self.dump_states = machine.anomaly | (machine.final & DUMP_FINAL_STATES)
        self.index = register_table(self)

    def actions_of(self, rows: tuple[int, ...] | None) -> list[str] | None:
        if rows is None:
            return None
        actions = self._actions
        return [name for index in rows for name in actions.get(index, ())]

    def wall_of(self, mono: float) -> float:
        return self._wall0 + (mono - self._mono0)

    def link_of(self, transfer_id: str) -> str:
        return "" if self.link is None else self.link(transfer_id)


class _Rings:
    """One traced table's records: its ring and its transfers' rings."""

    def __init__(self, meta: TableMeta, size: int):
        self.meta = meta
        self.all: deque = deque(maxlen=size)
        self.live: dict[str, deque] = {}
        self.ended: OrderedDict[str, deque] = OrderedDict()
        self.troubled: set[str] = set()  # transfers with a step that raised


class TraceRecorder:
    """Records every step of the tables it is given to (``recorder=`` of a table).

    ``side`` names this process or rank in traces ("P0", "D1"; by default host:pid).
    ``ring`` bounds the records kept per table, ``per_transfer`` those kept per transfer,
    ``transfers`` the live transfers tracked per table (beyond it, new ones are counted
    as untracked) and ``ended`` the ended transfers whose records are kept. ``file`` and
    ``dump`` are paths (or ``TraceWriter`` objects) for the full trace and for dumps of
    transfers that end badly. ``link(transfer_id)`` maps a transfer id to the key both
    sides' transfers of one request share (default: the id itself).

    A step's time is its event's (the host's monotonic clock, by the runtime's contract),
    so recording reads no clock; its wall time is derived from it. ``virtual_time``: the
    events carry a clock of the caller's own that every side shares (a simulation), and
    it stands for the wall clock as it is.
    """

    def __init__(
        self,
        side: str | None = None,
        *,
        ring: int = 4096,
        per_transfer: int = 256,
        transfers: int = 65536,
        ended: int = 64,
        file: str | Path | TraceWriter | None = None,
        dump: str | Path | TraceWriter | None = None,
        link: Callable[[str], str] | None = None,
        virtual_time: bool = False,
        processors: Iterable[Processor] = (),
        **writer_options: Any,
    ):
        for name, value in (
            ("ring", ring),
            ("per_transfer", per_transfer),
            ("transfers", transfers),
            ("ended", ended),
        ):
            if type(value) is not int or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        self.side = side or f"{socket.gethostname()}:{os.getpid()}"
        self.link = link
        self._ring_size, self._per_transfer = ring, per_transfer
        self._max_live, self._max_ended = transfers, ended
        self._processors = tuple(processors)
        self._owned: list[TraceWriter] = []
        self.writer = self._writer(file, writer_options)
        self.dump_writer = self._writer(dump, writer_options)
        self._seq = itertools.count(1)
        self._mono0 = 0.0 if virtual_time else time.monotonic()
        self._wall0 = 0.0 if virtual_time else time.time()
        self._lock = threading.Lock()
        self._rings: weakref.WeakKeyDictionary[Any, _Rings] = weakref.WeakKeyDictionary()
        self._keys: dict[str, int] = {}
        self.untracked = 0
        self.dumps = 0

    def _writer(self, target, options: dict) -> TraceWriter | None:
        if target is None or isinstance(target, TraceWriter):
            return target
        writer = TraceWriter(target, processors=self._processors, **options)
        self._owned.append(writer)
        return writer

    def wall_of(self, mono: float) -> float:
        return self._wall0 + (mono - self._mono0)

    # -- the table's side ------------------------------------------------------------------

    def bind_table(self, table: Any) -> Callable[..., None]:
        """Called by ``TransferTable`` when this recorder is set: the per-step function."""
        with self._lock:
            rings = self._rings.get(table)
            if rings is None:
                name = table.spec.name
                count = self._keys[name] = self._keys.get(name, 0) + 1
                key = name if count == 1 else f"{name}#{count}"
                rings = self._rings[table] = _Rings(TableMeta(self, table, key), self._ring_size)
        meta = rings.meta
        index = meta.index
        ring_append = rings.all.append
        next_seq = self._seq.__next__
        ident = threading.get_ident
        live, ended, final = rings.live, rings.ended, meta.final
        per_transfer, max_live = self._per_transfer, self._max_live
        submit = self.writer.submit if self.writer is not None else None
        finish = self._finish

        def keep(raw, tid: str, result) -> None:
            """The transfer's ring: made at its creation, moved aside when it ends."""
            ring = live.get(tid)
            if ring is None:
                if result is None or result.outcome is not _CREATED:
                    ring = ended.get(tid)  # a late event for an ended transfer
                    if ring is not None:
                        ring.append(raw)
                    return
                if len(live) >= max_live:
                    self.untracked += 1
                    return
                ring = live[tid] = deque(maxlen=per_transfer)
            ring.append(raw)
            if result is None:
                rings.troubled.add(tid)
            elif result.state in final:
                finish(rings, tid, ring, result.state)

        live_get = live.get

        # Two variants, so the one without a file pays no test for it per step; the common
        # case (a live transfer's step that does not end it) is written out in both.
        if submit is None:

            def record(ev, before, result, rows, error=None) -> None:
                if error is None:
                    raw: tuple = (next_seq(), ident(), index, ev, before, result, rows)
                    ring_append(raw)
                    ring = live_get(ev.transfer_id)
                    if ring is not None and result.state not in final:
                        ring.append(raw)
                        return
                else:
                    raw = (next_seq(), ident(), index, ev, before, result, rows, error)
                    ring_append(raw)
                keep(raw, ev.transfer_id, result)
        else:

            def record(ev, before, result, rows, error=None) -> None:
                if error is None:
                    raw: tuple = (next_seq(), ident(), index, ev, before, result, rows)
                    ring_append(raw)
                    submit(raw)
                    ring = live_get(ev.transfer_id)
                    if ring is not None and result.state not in final:
                        ring.append(raw)
                        return
                else:
                    raw = (next_seq(), ident(), index, ev, before, result, rows, error)
                    ring_append(raw)
                    submit(raw)
                keep(raw, ev.transfer_id, result)

        return record

    def _finish(self, rings: _Rings, tid: str, ring: deque, state: str) -> None:
        with self._lock:
            rings.live.pop(tid, None)
            rings.ended[tid] = ring
            if len(rings.ended) > self._max_ended:
                rings.ended.popitem(last=False)
        troubled = tid in rings.troubled
        if troubled:
            rings.troubled.discard(tid)
        if self.dump_writer is not None and (state in rings.meta.dump_states or troubled):
            self.dump_writer.submit_many(list(ring))
            self.dumps += 1

    # -- reading it back -------------------------------------------------------------------

    def records(self, transfer_id: str | None = None) -> list[Step]:
        """The records kept, rendered: every table's ring, or one transfer's records."""
        return [self._renderer().step(raw) for raw in self._raw(transfer_id)]

    def _raw(self, transfer_id: str | None) -> list[tuple]:
        with self._lock:
            if transfer_id is None:
                raws = [raw for rings in self._rings.values() for raw in list(rings.all)]
            else:
                raws = []
                for rings in list(self._rings.values()):
                    ring = rings.live.get(transfer_id) or rings.ended.get(transfer_id)
                    if ring is not None:
                        raws.extend(list(ring))
        raws.sort(key=lambda raw: raw[0])
        return raws

    def tables(self) -> list[TableInfo]:
        with self._lock:
            return [rings.meta.info for rings in self._rings.values()]

    def save(self, path: str | Path, transfer_id: str | None = None) -> int:
        """Write the records kept (or one transfer's) to a trace file now, on the
        calling thread (an operator's request, never a dispatch); returns the count."""
        renderer = self._renderer()
        steps = [renderer.step(raw) for raw in self._raw(transfer_id)]
        used = {step.table for step in steps}
        return write_trace(path, [*(i for i in self.tables() if i.table in used), *steps]) - len(
            used
        )

    def _renderer(self) -> StepRenderer:
        return StepRenderer(self._processors)

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until the writers wrote everything recorded so far."""
        return all(w.flush(timeout) for w in (self.writer, self.dump_writer) if w is not None)

    def close(self) -> None:
        """Flush and stop the writers this recorder opened (those passed in stay open)."""
        for writer in self._owned:
            writer.close()

    def stats(self) -> dict[str, Any]:
        with self._lock:
            kept = sum(len(rings.all) for rings in self._rings.values())
            live = sum(len(rings.live) for rings in self._rings.values())
        return {
            "kept": kept,
            "live_transfers": live,
            "untracked": self.untracked,
            "dumps": self.dumps,
            "writer": None if self.writer is None else self.writer.stats(),
            "dump_writer": None if self.dump_writer is None else self.dump_writer.stats(),
        }


def trace_events(
    spec: str,
    events: Iterable[Any],
    *,
    config: dict | None = None,
    executor: str = "compiled",
    side: str = "trace",
    **table_options: Any,
) -> tuple[list[TableInfo], list[Step]]:
    """Dispatch ``events`` through a fresh table of ``spec`` (a shipped name or a spec
    file) and return its table line and one ``Step`` per dispatch, ready for
    ``write_trace(path, [*tables, *steps])``. A step that raises is recorded as such
    (outcome ``raised``) and the next event is dispatched."""
    from ..machines import build_table
    from ..runtime.errors import InvariantViolation, TransitionError

    recorder = TraceRecorder(
        side, ring=1 << 30, per_transfer=1, transfers=1, ended=1, virtual_time=True
    )
    table = build_table(spec, executor=executor, config=config, recorder=recorder, **table_options)
    for event in events:
        try:
            table.dispatch(event)
        except (TransitionError, InvariantViolation):
            pass
    return recorder.tables(), recorder.records()

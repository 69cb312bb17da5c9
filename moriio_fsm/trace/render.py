"""Turning a raw step record into a trace line: a structlog processor chain and its JSON renderer.

Rules: the dispatching thread keeps only a raw tuple (references to the immutable event,
result and effects); everything here runs later, on a writer thread or when a ring is
read. The chain is structlog's: ``step_fields`` makes the event dict, any processors the
application adds run next (to redact or annotate), and ``JSONRenderer`` with msgspec
writes the line. A value JSON cannot hold is written as its ``repr``.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable
from typing import Any, cast

import msgspec
import structlog
from msgspec.structs import asdict

from ..runtime.events import Outcome
from .format import RAISED, Step

Processor = Callable[[Any, str, dict], Any]

#: Positions in a raw record (a plain tuple, built on the dispatching thread). It holds
#: only numbers, strings, tuples and the runtime's untracked Structs, so the garbage
#: collector stops tracking it at once, however many a ring keeps: the table it came
#: from is an index into ``TABLES`` rather than a reference.
#: ``ERROR`` is only there for a step that raised.
SEQ, THREAD, META, EVENT, BEFORE, RESULT, ROWS, ERROR = range(8)

#: What rendering needs of every traced table, by index (append-only: a few per process).
TABLES: list = []
_tables_lock = threading.Lock()


def register_table(meta: Any) -> int:
    with _tables_lock:
        TABLES.append(meta)
        return len(TABLES) - 1


def meta_of(raw: tuple) -> Any:
    return TABLES[raw[META]]


_PID = os.getpid()
_OUTCOME_NAMES = tuple(o.value for o in Outcome)
_thread_names: dict[int, str] = {}


def thread_name(ident: int) -> str:
    """The name of the thread ``ident`` (looked up once; idents of dead threads may be
    reused, so a name is a hint, the ident is exact)."""
    name = _thread_names.get(ident)
    if name is None:
        for thread in threading.enumerate():
            if thread.ident is not None:  # always, for a thread that runs
                _thread_names[thread.ident] = thread.name
        name = _thread_names.setdefault(ident, f"thread-{ident}")
    return name


def _as_json(value: Any) -> Any:
    """``value`` as JSON gives it back: tuples (at any depth) become lists."""
    if value.__class__ is tuple or value.__class__ is list:
        return [_as_json(item) for item in value]
    if value.__class__ is dict:
        return {key: _as_json(item) for key, item in value.items()}
    return value


_MISSING = object()


def same_effect(recorded: dict, effect: Any, transfer_id: str) -> bool:
    """Whether ``effect`` is the one ``recorded`` (as ``effect_dict`` wrote it): its
    fields as a dict, compared in one go; only an effect with tuple fields (which the
    trace holds as lists) takes the slower way."""
    fields = asdict(effect)
    if fields.pop("transfer_id") != transfer_id:
        fields["transfer_id"] = effect.transfer_id
    fields["kind"] = effect.kind
    return fields == recorded or effect_dict(effect, transfer_id) == recorded


def effect_dict(effect: Any, transfer_id: str) -> dict[str, Any]:
    """An effect as the trace holds it: ``kind`` first, then its fields as JSON values
    (tuples become lists), ``transfer_id`` only when it is not the step's."""
    fields = msgspec.to_builtins(effect, enc_hook=repr)
    if fields.pop("transfer_id", transfer_id) != transfer_id:
        fields["transfer_id"] = effect.transfer_id
    result = {"kind": effect.kind}
    for key, value in fields.items():
        cls = value.__class__
        result[key] = _as_json(value) if cls is tuple or cls is list or cls is dict else value
    return result


def step_fields(_logger: Any, _name: str, event_dict: dict) -> dict:
    """The first processor: the raw record under ``"raw"`` becomes the step's fields."""
    raw = event_dict.pop("raw")
    meta, ev, result, rows = TABLES[raw[META]], raw[EVENT], raw[RESULT], raw[ROWS]
    error = raw[ERROR] if len(raw) > ERROR else None
    tid = ev.transfer_id
    before = raw[BEFORE]
    event_dict.update(
        {
            "type": "step",
            "seq": raw[SEQ],
            "side": meta.side,
            "table": meta.key,
            "transfer": tid,
            "event": ev.kind,
            "t": ev.time,
            "data": ev.data,
            "source": ev.source,
            "before": before,
            "after": before if result is None else result.state,
            "outcome": RAISED if result is None else _OUTCOME_NAMES[result.outcome.index],
            "rows": rows,
            "actions": meta.actions_of(rows),
            "effects": [] if result is None else [effect_dict(e, tid) for e in result.effects],
            "wall": meta.wall_of(ev.time),
            "pid": _PID,
            "thread": thread_name(raw[THREAD]),
        }
    )
    link = meta.link_of(tid)
    if link and link != tid:
        event_dict["link"] = link
    if error is not None:
        event_dict["error"] = f"{type(error).__name__}: {error}"
    return event_dict


class StepRenderer:
    """Renders raw records through ``step_fields``, the given processors and a JSON
    renderer; ``line(raw)`` gives the bytes of one trace line, ``step(raw)`` a ``Step``."""

    def __init__(self, processors: Iterable[Processor] = ()):
        encoder = msgspec.json.Encoder(enc_hook=repr)
        self._chain = [step_fields, *processors]
        # The serializer makes bytes, so the renderer returns bytes (typed str | bytes).
        self._json = cast(
            Callable[..., bytes],
            structlog.processors.JSONRenderer(serializer=lambda d, **_: encoder.encode(d)),
        )

    def fields(self, raw: tuple) -> dict:
        event_dict: dict = {"raw": raw}
        for processor in self._chain:
            event_dict = processor(None, "step", event_dict)
        return event_dict

    def line(self, raw: tuple) -> bytes:
        return self._json(None, "step", self.fields(raw)) + b"\n"

    def step(self, raw: tuple) -> Step:
        return msgspec.json.decode(self.line(raw), type=Step)

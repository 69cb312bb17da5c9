"""Transfers as OpenTelemetry spans: one span per transfer and side, a child per state it was in.

Rules: ``TransferSpans`` is a step recorder placed around a table's own recorder (``around``);
on the dispatching thread it only notes state changes (a few tuple appends under its own
lock, bounded in transfers and in states per transfer). When a transfer closes (a final
state, or a state the caller names as closing) its story goes to the exporter's bounded
queue (``otel_export.py``, imported only here and only when spans are on), which builds and
exports the spans on its own threads. The parent of a transfer's span is the trace context
``link`` gave its key (the request's W3C ``traceparent``); without one it is a new trace.
Both the watch and the project's connector use this module, so their spans have one shape.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from typing import Any

from ..runtime.events import Outcome
from .otel_story import TransferStory

MAX_LIVE = 1 << 16
MAX_STATES = 64
MAX_HEADER_LENGTH = 512
_CREATED = Outcome.CREATED


def trace_headers_of(value: Any) -> dict[str, str] | None:
    """The W3C trace headers (``traceparent``, ``tracestate``) of a request's
    ``trace_headers``, or None when it carries none usable (anything ill-typed is dropped)."""
    if not isinstance(value, Mapping):
        return None
    found = {
        name: text
        for name in ("traceparent", "tracestate")
        if isinstance(text := value.get(name), str) and 0 < len(text) <= MAX_HEADER_LENGTH
    }
    return found if "traceparent" in found else None


class _Tee:
    """A step recorder that records into ``inner`` (if any) and then into the spans."""

    def __init__(self, inner: Any, spans: TransferSpans):
        self.inner, self.spans = inner, spans

    def bind_table(self, table: Any):
        bind = getattr(self.inner, "bind_table", None)
        inner_record = bind(table) if bind is not None else None
        note = self.spans.bind_table(table)
        if inner_record is None:
            return note

        def record(ev, before, result, rows, error=None) -> None:
            try:
                inner_record(ev, before, result, rows, error)
            finally:
                note(ev, before, result, rows, error)

        return record

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class TransferSpans:
    """The transfers of one side (``side`` names it: "D-dp0"), noted for their spans.

    ``closing`` maps a machine's name to states that close its span besides the final ones
    (a state the machine only lingers in for its own bookkeeping). ``exporter`` takes each
    closed story (``submit``); by default the process's OTLP exporter.
    """

    def __init__(
        self,
        side: str,
        *,
        closing: Mapping[str, Iterable[str]] | None = None,
        exporter: Any = None,
        max_live: int = MAX_LIVE,
    ):
        if exporter is None:
            from .otel_export import span_exporter

            exporter = span_exporter()
        self.side = side
        self.exporter = exporter
        self._closing = {name: frozenset(states) for name, states in (closing or {}).items()}
        self._max_live = max_live
        self._live: dict[tuple[str, str], TransferStory] = {}
        self._links: OrderedDict[str, tuple[str, dict[str, str] | None]] = OrderedDict()
        self._lock = threading.Lock()
        self.untracked = 0

    def around(self, inner: Any) -> _Tee:
        """The step recorder to give a table: ``inner`` records as before, spans besides."""
        return _Tee(inner, self)

    def link(self, key: str, request_id: str, trace_headers: Any) -> None:
        """Name the request of the transfer ``key`` and its trace context (vLLM's
        ``Request.trace_headers``); the latest link of a key wins, the oldest go first."""
        headers = trace_headers_of(trace_headers)
        with self._lock:
            self._links[key] = (str(request_id), headers)
            self._links.move_to_end(key)
            while len(self._links) > self._max_live:
                self._links.popitem(last=False)

    def bind_table(self, table: Any):
        """The per-step function for ``table`` (a step recorder's contract)."""
        machine = table.spec.name
        machine_spec = table.machine
        closing = frozenset(machine_spec.final) | self._closing.get(machine, frozenset())
        anomaly_states = frozenset(machine_spec.anomaly)

        def record(ev, before, result, rows, error=None) -> None:
            if result is None or result.state is None:
                return
            try:
                self._note(machine, closing, anomaly_states, ev, result)
            except Exception:  # a span is never worth a step
                self.untracked += 1

        return record

    def _note(self, machine, closing, anomaly_states, ev, result) -> None:
        key, now = ev.transfer_id, ev.time
        closed = None
        with self._lock:
            story = self._live.get((machine, key))
            if story is None:
                if result.outcome is not _CREATED or len(self._live) >= self._max_live:
                    return
                first = result.hops[0][0] if result.hops else result.state
                story = TransferStory(machine, key, self.side, [(first, now)])
                self._live[(machine, key)] = story
            for _, entered in result.hops or ():
                if entered != story.states[-1][0] and len(story.states) < MAX_STATES:
                    story.states.append((entered, now))
            for effect in result.effects:
                if effect.kind == "note_anomaly":
                    story.anomalies.append(str(getattr(effect, "anomaly", "")))
                elif effect.kind == "transfer_ended":
                    story.outcome = str(getattr(effect, "outcome", ""))
            if result.state in closing:
                closed = self._live.pop((machine, key))
                closed.end = now
                closed.outcome = closed.outcome or result.state
                if result.state in anomaly_states:
                    closed.anomalies.append(result.state)
                # Each side runs one machine per transfer: its story closing ends the link.
                link = self._links.pop(key, None)
                if link is not None:
                    closed.request_id, closed.headers = link
        if closed is not None:
            self.exporter.submit(closed)

    def live(self) -> int:
        with self._lock:
            return len(self._live)

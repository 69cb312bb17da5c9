"""The process's OpenTelemetry exporter: transfer stories become spans, sent over OTLP.

Imported only when spans are on (the ``otel`` extra). Rules: whoever submits never waits
and never sees an error: stories wait in a bounded queue (the oldest dropped and counted
when it is full), one thread of ours makes them into spans, and the SDK's batch processor
exports those from its own thread and bounded queue. The exporter is configured the
standard way (``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` or ``OTEL_EXPORTER_OTLP_ENDPOINT``,
``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` ``http/protobuf`` (default) or ``grpc``,
``OTEL_SERVICE_NAME``...). A failed export is logged once, then counted.
"""

from __future__ import annotations

import atexit
import os
import threading
from collections import deque
from collections.abc import Mapping
from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    SpanExporter,
    SpanExportResult,
)
from opentelemetry.trace import Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from ..logs import get_logger
from .otel_story import TransferStory, wall_ns

log = get_logger("moriio_fsm.otel")

MAX_QUEUED = 4096
SPAN_QUEUE = 8192
_PROPAGATOR = TraceContextTextMapPropagator()


def parent_context(headers: Mapping[str, str] | None) -> Any:
    """The OpenTelemetry context of W3C ``headers``; an empty one (a new trace) when they
    are missing or malformed."""
    return _PROPAGATOR.extract(dict(headers or {}))


def context_headers(span: Any) -> dict[str, str]:
    """The W3C headers (``traceparent``, ``tracestate``) that make ``span`` the parent."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
    return carrier


def _otlp_exporter() -> SpanExporter:
    protocol = os.environ.get(
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
        os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"),
    )
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
            OTLPSpanExporter,
        )
    return OTLPSpanExporter()


class _LoggedOnce(SpanExporter):
    """The OTLP exporter, its failures logged once and counted."""

    def __init__(self, inner: SpanExporter):
        self.inner = inner
        self.failures = 0
        self.exported = 0

    def export(self, spans):
        try:
            result = self.inner.export(spans)
        except Exception as exc:
            result = SpanExportResult.FAILURE
            why = f"{type(exc).__name__}: {exc}"
        else:
            why = "the collector refused or could not be reached"
        if result is SpanExportResult.SUCCESS:
            self.exported += len(spans)
            return result
        self.failures += 1
        if self.failures == 1:
            log.warning(
                "otel.export_failed", spans=len(spans), why=why, then="dropping them (logged once)"
            )
        return result

    def shutdown(self) -> None:
        self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.inner.force_flush(timeout_millis)


class SpanExport:
    """Stories in, spans out: the queue, the thread that makes spans, the SDK's exporter."""

    def __init__(self, exporter: SpanExporter | None = None):
        attributes = {} if os.environ.get("OTEL_SERVICE_NAME") else {"service.name": "moriio-fsm"}
        self.provider = TracerProvider(resource=Resource.create(attributes))
        self.exporter = _LoggedOnce(exporter if exporter is not None else _otlp_exporter())
        self.processor = BatchSpanProcessor(self.exporter, max_queue_size=SPAN_QUEUE)
        self.provider.add_span_processor(self.processor)
        self.tracer = self.provider.get_tracer("moriio_fsm")
        self.dropped = 0
        self.failed = 0
        self._queue: deque[TransferStory] = deque()
        self._wake = threading.Condition()
        self._busy = False
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="moriio-fsm-spans", daemon=True)
        self._thread.start()

    def submit(self, story: TransferStory) -> None:
        """Queue ``story``; never waits (a full queue drops its oldest story)."""
        with self._wake:
            if len(self._queue) >= MAX_QUEUED:
                self._queue.popleft()
                self.dropped += 1
            self._queue.append(story)
            self._wake.notify()

    def _run(self) -> None:
        while True:
            with self._wake:
                self._busy = False
                self._wake.notify_all()
                while not self._queue and not self._closed:
                    self._wake.wait()
                if not self._queue:
                    return
                batch = list(self._queue)
                self._queue.clear()
                self._busy = True
            for story in batch:
                self._emit_safely(story)

    def _emit_safely(self, story: TransferStory) -> None:
        try:
            self.emit(story)
        except Exception:
            self.failed += 1
            if self.failed == 1:
                log.exception("otel.span_failed", key=story.key, then="dropping it (logged once)")

    def emit(self, story: TransferStory) -> None:
        """The transfer's span and one child per state it was in, with their times."""
        attributes = {
            "moriio_fsm.transfer.key": story.key,
            "moriio_fsm.request.id": story.request_id,
            "gen_ai.request.id": story.request_id,
            "moriio_fsm.role": story.role,
            "moriio_fsm.side": story.side,
            "moriio_fsm.machine": story.machine,
            "moriio_fsm.outcome": story.outcome,
            "moriio_fsm.anomalies": list(story.anomalies),
        }
        span = self.tracer.start_span(
            story.machine,
            context=parent_context(story.headers),
            start_time=wall_ns(story.states[0][1]),
            attributes=attributes,
        )
        inside = trace.set_span_in_context(span)
        # The last state is the one that closed the span: the children are those before it.
        for (state, entered), (_, left) in zip(story.states, story.states[1:]):
            child = self.tracer.start_span(
                f"{story.machine}.{state}",
                context=inside,
                start_time=wall_ns(entered),
                attributes={"moriio_fsm.state": state, "moriio_fsm.transfer.key": story.key},
            )
            child.end(end_time=wall_ns(left))
        if story.anomalies:
            span.set_status(Status(StatusCode.ERROR, ", ".join(story.anomalies)))
        span.end(end_time=wall_ns(story.end))

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until every story queued so far is exported (for tests and shutdown)."""
        with self._wake:
            done = self._wake.wait_for(lambda: not self._queue and not self._busy, timeout_s)
        return done and self.provider.force_flush(int(timeout_s * 1000))

    def close(self, timeout_s: float = 2.0) -> None:
        with self._wake:
            self._closed = True
            self._wake.notify_all()
        self._thread.join(timeout_s)
        # The SDK's shutdown exports what is left and may wait on an unreachable
        # collector: it gets ``timeout_s`` on a thread of its own, never more.
        last = threading.Thread(target=self.processor.shutdown, name="moriio-fsm-spans-close")
        last.daemon = True
        last.start()
        last.join(timeout_s)

    def stats(self) -> dict[str, int]:
        return {
            "queued": len(self._queue),
            "dropped": self.dropped,
            "failed": self.failed,
            "exported": self.exporter.exported,
            "export_failures": self.exporter.failures,
        }


_lock = threading.Lock()
_export: SpanExport | None = None
_pid = 0


def span_exporter() -> SpanExport:
    """The process's exporter, started on first use (again in a forked child)."""
    global _export, _pid
    with _lock:
        if _export is None or _pid != os.getpid():
            _export, _pid = SpanExport(), os.getpid()
            atexit.register(_export.close)
        return _export

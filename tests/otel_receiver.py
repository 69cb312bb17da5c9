"""A tiny OTLP/HTTP trace receiver on 127.0.0.1 for the OpenTelemetry tests, and the fixture
that makes it the process's span destination.

The receiver decodes each ``ExportTraceServiceRequest`` (protobuf, optionally gzipped) with
opentelemetry-proto and keeps its spans as plain dicts; ``wait_for`` returns once a
condition on them holds or its time is up. ``otlp`` points the process's exporter
(``moriio_fsm.trace.otel_export``) at a fresh receiver through the standard
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` and stops both afterwards.
"""

from __future__ import annotations

import gzip
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

pytest.importorskip("opentelemetry.sdk", reason="the otel extra is not installed")
pytest.importorskip("opentelemetry.proto", reason="opentelemetry-proto is not installed")

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (  # noqa: E402
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

W3C_TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
W3C_SPAN_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{W3C_TRACE_ID}-{W3C_SPAN_ID}-01"


def _value(any_value):
    kind = any_value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in any_value.array_value.values]
    return getattr(any_value, kind) if kind else None


def _spans_of(payload: bytes) -> list[dict]:
    request = ExportTraceServiceRequest()
    request.ParseFromString(payload)
    spans = []
    for resource_spans in request.resource_spans:
        resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                spans.append(
                    {
                        "name": span.name,
                        "trace_id": span.trace_id.hex(),
                        "span_id": span.span_id.hex(),
                        "parent_span_id": span.parent_span_id.hex(),
                        "start": span.start_time_unix_nano,
                        "end": span.end_time_unix_nano,
                        "status": span.status.code,
                        "attributes": {a.key: _value(a.value) for a in span.attributes},
                        "service": resource.get("service.name"),
                    }
                )
    return spans


class OtlpReceiver:
    """Accepts ``POST /v1/traces`` and keeps the spans; everything else is a 404."""

    def __init__(self):
        self.spans: list[dict] = []
        self.posts = 0
        self.bad_posts = 0
        self._changed = threading.Condition()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                length = int(self.headers.get("content-length") or 0)
                body = self.rfile.read(length)
                if self.headers.get("content-encoding") == "gzip":
                    body = gzip.decompress(body)
                try:
                    spans = _spans_of(body) if self.path == "/v1/traces" else None
                except Exception:
                    spans = None
                with receiver._changed:
                    receiver.posts += 1
                    if spans is None:
                        receiver.bad_posts += 1
                    else:
                        receiver.spans.extend(spans)
                    receiver._changed.notify_all()
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200 if spans is not None else 404)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args):  # quiet
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"

    def wait_for(self, condition, timeout_s: float = 15.0) -> list[dict]:
        """The spans received, once ``condition(spans)`` holds or ``timeout_s`` passed."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while not condition(self.spans):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._changed.wait(left)
            return list(self.spans)

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)


def named(spans: list[dict], name: str) -> list[dict]:
    return [s for s in spans if s["name"] == name]


def children_of(spans: list[dict], parent: dict) -> list[dict]:
    """The spans whose parent is ``parent``, in start order."""
    found = [s for s in spans if s["parent_span_id"] == parent["span_id"]]
    return sorted(found, key=lambda s: (s["start"], s["end"]))


@pytest.fixture
def otlp(monkeypatch):
    """A receiver the process's span exporter sends to (a fresh exporter, closed after)."""
    from moriio_fsm.trace import otel_export

    receiver = OtlpReceiver()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", receiver.endpoint)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", raising=False)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_PROTOCOL", raising=False)
    export = otel_export.SpanExport()
    monkeypatch.setattr(otel_export, "_export", export)
    monkeypatch.setattr(otel_export, "_pid", os.getpid())
    receiver.export = export
    yield receiver
    export.close()
    receiver.stop()

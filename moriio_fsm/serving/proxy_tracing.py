"""The proxy's part in a request's trace: the client's W3C context passed on to P and D.

Rules: a valid ``traceparent`` (and its ``tracestate``) from the client goes on to P and D
unchanged; a malformed one is dropped (P's and D's spans then start a trace of their own).
With ``otel`` on, the proxy opens a span of its own, a child of the client's context or a
new root when there is none, and P and D get that span's context instead, so one trace
holds the proxy's span, P's and D's. The headers of the request being routed live in a
context variable that the requests to P and D read (``outgoing``); OpenTelemetry is
imported only when ``otel`` is on.
"""

from __future__ import annotations

import re
from contextvars import ContextVar
from typing import Any

_TRACEPARENT = re.compile(r"^([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$")
MAX_TRACESTATE = 512

_outgoing: ContextVar[dict[str, str] | None] = ContextVar("moriio_fsm_trace", default=None)


def incoming(headers: Any) -> dict[str, str]:
    """The client's W3C trace headers, if its ``traceparent`` is valid; else none."""
    parent = (headers.get("traceparent") or "").strip().lower()
    found = _TRACEPARENT.match(parent)
    if found is None:
        return {}
    version, trace_id, span_id, _ = found.groups()
    if version == "ff" or trace_id == "0" * 32 or span_id == "0" * 16:
        return {}
    kept = {"traceparent": parent}
    state = (headers.get("tracestate") or "").strip()
    if state and len(state) <= MAX_TRACESTATE and state.isprintable():
        kept["tracestate"] = state
    return kept


def outgoing() -> dict[str, str]:
    """The trace headers the request being routed passes to P and D."""
    return dict(_outgoing.get() or {})


class RequestTrace:
    """One client request's trace: its headers for P and D, and the proxy's span if on."""

    def __init__(self, headers: Any, otel: bool, route: str = "/v1/completions"):
        client = incoming(headers)
        self.span: Any = None
        if otel:
            from ..trace.otel_export import context_headers, parent_context, span_exporter

            tracer = span_exporter().tracer
            self.span = tracer.start_span(
                f"proxy {route}",
                context=parent_context(client),
                attributes={"moriio_fsm.role": "proxy", "http.route": route},
            )
            client = context_headers(self.span)
        _outgoing.set(client)

    def finish(self, response: Any) -> Any:
        """End the proxy's span once ``response`` is sent (after its stream, if it streams)."""
        if self.span is None:
            return response
        transfer_id = response.headers.get("x-transfer-id")
        if transfer_id:
            self.span.set_attribute("moriio_fsm.transfer.key", transfer_id)
        self.span.set_attribute("http.response.status_code", response.status_code)
        body = getattr(response, "body_iterator", None)
        if body is None:
            self._end(response.status_code)
        else:
            response.body_iterator = self._then_end(body, response.status_code)
        return response

    async def _then_end(self, body: Any, status: int):
        try:
            async for chunk in body:
                yield chunk
        finally:
            self._end(status)

    def _end(self, status: int) -> None:
        if status >= 500:
            from opentelemetry.trace import Status, StatusCode

            self.span.set_status(Status(StatusCode.ERROR, f"HTTP {status}"))
        self.span.end()

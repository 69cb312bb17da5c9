"""The proxy and the request's trace: the client's W3C context reaches P and D, and with
``otel`` on the proxy's own span (exported over OTLP to a receiver the test runs) sits
between the client and them; a malformed ``traceparent`` is never passed on."""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import pytest
from fake_vllm import post

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from otel_receiver import (  # noqa: E402
    TRACEPARENT,
    W3C_SPAN_ID,
    W3C_TRACE_ID,
    named,
    otlp,  # noqa: F401 (a fixture)
)

from moriio_fsm.serving.proxy_tracing import incoming  # noqa: E402

BODY = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 4}


def _parent_of(headers: dict) -> tuple[str, str]:
    _, trace_id, span_id, _ = headers["traceparent"].split("-")
    return trace_id, span_id


@pytest.mark.parametrize("mode", ["write", "read"])
def test_without_otel_the_clients_context_reaches_p_and_d_unchanged(fakes, proxy_for, mode):
    p, d = fakes("P"), fakes("D")
    proxy = proxy_for(mode, [p.spec()], [d.spec()])
    headers = {"traceparent": TRACEPARENT, "tracestate": "vendor=abc"}
    assert post(proxy, BODY, headers=headers).status_code == 200
    for fake in (p, d):
        (seen,) = fake.received_headers
        assert seen["traceparent"] == TRACEPARENT
        assert seen["tracestate"] == "vendor=abc"


@pytest.mark.parametrize(
    "bad",
    [
        "garbage",
        f"00-{'0' * 32}-{W3C_SPAN_ID}-01",  # an all-zero trace id
        f"00-{W3C_TRACE_ID}-{'0' * 16}-01",  # an all-zero span id
        f"ff-{W3C_TRACE_ID}-{W3C_SPAN_ID}-01",  # the forbidden version
        f"00-{W3C_TRACE_ID}-{W3C_SPAN_ID}-01-extra\r\nx-evil: 1",
        "00-" + "g" * 32 + f"-{W3C_SPAN_ID}-01",
    ],
)
def test_a_malformed_traceparent_is_not_passed_on(fakes, proxy_for, bad):
    p, d = fakes("P"), fakes("D")
    proxy = proxy_for("write", [p.spec()], [d.spec()])
    try:
        reply = post(proxy, BODY, headers={"traceparent": bad, "tracestate": "k=v"})
    except (httpx.LocalProtocolError, ValueError):
        return  # the client library itself refuses to send it: nothing reaches the proxy
    assert reply.status_code == 200
    for fake in (p, d):
        (seen,) = fake.received_headers
        assert "traceparent" not in seen and "tracestate" not in seen


def test_the_proxys_span_parents_p_and_d_under_the_clients_trace(fakes, proxy_for, otlp):  # noqa: F811
    p, d = fakes("P"), fakes("D")
    proxy = proxy_for("write", [p.spec()], [d.spec()], otel=True)
    reply = post(proxy, BODY, headers={"traceparent": TRACEPARENT})
    assert reply.status_code == 200
    otlp.export.flush()
    spans = otlp.wait_for(lambda s: named(s, "proxy /v1/completions"))
    (span,) = named(spans, "proxy /v1/completions")
    assert span["trace_id"] == W3C_TRACE_ID and span["parent_span_id"] == W3C_SPAN_ID
    assert span["attributes"]["moriio_fsm.transfer.key"] == reply.headers["x-transfer-id"]
    assert span["attributes"]["http.response.status_code"] == 200
    for fake in (p, d):
        (seen,) = fake.received_headers
        assert _parent_of(seen) == (W3C_TRACE_ID, span["span_id"])


def test_with_no_client_context_the_proxy_starts_the_trace(fakes, proxy_for, otlp):  # noqa: F811
    p, d = fakes("P"), fakes("D", tokens=[4, 5])
    proxy = proxy_for("read", [p.url], [d.url], otel=True)
    with httpx.stream(
        "POST", f"{proxy.url}/v1/completions", json=dict(BODY, stream=True), timeout=30
    ) as reply:
        assert reply.status_code == 200
        assert b"[DONE]" in b"".join(reply.iter_bytes())
    otlp.export.flush()
    spans = otlp.wait_for(lambda s: named(s, "proxy /v1/completions"))
    (span,) = named(spans, "proxy /v1/completions")
    assert span["parent_span_id"] == ""  # a root
    (to_p,), (to_d,) = p.received_headers, d.received_headers
    assert _parent_of(to_p) == _parent_of(to_d) == (span["trace_id"], span["span_id"])


def test_a_malformed_traceparent_with_otel_on_gives_a_new_root(fakes, proxy_for, otlp):  # noqa: F811
    p, d = fakes("P"), fakes("D")
    proxy = proxy_for("write", [p.spec()], [d.spec()], otel=True)
    bad = f"00-{W3C_TRACE_ID}-{'0' * 16}-01"
    assert post(proxy, BODY, headers={"traceparent": bad}).status_code == 200
    otlp.export.flush()
    (span,) = named(
        otlp.wait_for(lambda s: named(s, "proxy /v1/completions")), "proxy /v1/completions"
    )
    assert span["parent_span_id"] == "" and span["trace_id"] != W3C_TRACE_ID
    assert _parent_of(d.received_headers[0]) == (span["trace_id"], span["span_id"])


def test_incoming_keeps_only_a_valid_context():
    assert incoming({"traceparent": TRACEPARENT.upper()}) == {"traceparent": TRACEPARENT}
    assert incoming({"tracestate": "k=v"}) == {}
    assert incoming({"traceparent": TRACEPARENT, "tracestate": "x" * 600}) == {
        "traceparent": TRACEPARENT
    }

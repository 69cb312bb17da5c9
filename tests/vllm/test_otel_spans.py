"""OpenTelemetry spans of transfers through vLLM's real scheduler: the watch (around the
project's connector) and the project's connector itself, exporting over OTLP/HTTP to a
receiver the test runs. Each side's transfer is one span, parented on the request's
``trace_headers``, with one child per state the machine was in; off by default, and a
collector that is down or never answers changes nothing a transfer does."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from harness import run_until, write_pair_params
from watch_harness import WatchInstance

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from otel_receiver import (  # noqa: E402
    TRACEPARENT,
    W3C_SPAN_ID,
    W3C_TRACE_ID,
    children_of,
    named,
    otlp,  # noqa: F401 (a fixture)
)

PROMPT = list(range(10, 50))
CLIENT = {"traceparent": TRACEPARENT, "tracestate": "vendor=abc"}


@pytest.fixture
def make_watched(tiny_model):
    made = []

    def make(name, kv_role, **watch):
        made.append(WatchInstance(name, kv_role, False, tiny_model, watch=watch))
        return made[-1]

    yield make
    for instance in made:
        instance.close()


def _pair(make, otel: bool, tid: str, headers=CLIENT):
    p, d = make("P", "kv_producer", otel), make("D", "kv_consumer", otel)
    to_p, to_d = write_pair_params(tid, p, d)
    p.add("req-p", PROMPT, 1, to_p, trace_headers=headers)
    d.add("req-d", PROMPT, 4, to_d, trace_headers=headers)
    assert run_until([p, d], lambda: len(d.outputs.get("req-d", [])) == 4)
    assert run_until([p, d], lambda: p.empty() and d.empty())
    return p, d


def _watched_pair(make_watched, tid, headers=CLIENT, otel=True):
    return _pair(lambda n, r, o: make_watched(n, r, otel=o), otel, tid, headers)


def _spans(otlp, machines):  # noqa: F811
    otlp.export.flush()
    return otlp.wait_for(lambda s: all(named(s, m) for m in machines))


def _path(steps) -> list[str]:
    """The states one transfer's flight-recorder steps went through, in order."""
    states: list[str] = []
    for step in steps:
        for state in (step.before, step.after):
            if state and (not states or states[-1] != state):
                states.append(state)
    return states


def test_the_watch_sends_one_span_per_side_with_a_child_per_state(make_watched, otlp):  # noqa: F811
    p, d = _watched_pair(make_watched, "tx-otel")
    spans = _spans(otlp, ["watch_producer", "watch_consumer"])
    (d_span,), (p_span,) = named(spans, "watch_consumer"), named(spans, "watch_producer")
    for span, request_id, role, outcome in (
        (d_span, "req-d", "consumer", "received"),
        (p_span, "req-p", "producer", "sent"),
    ):
        assert span["trace_id"] == W3C_TRACE_ID and span["parent_span_id"] == W3C_SPAN_ID
        attributes = span["attributes"]
        assert attributes["moriio_fsm.transfer.key"] == "tx-otel"
        assert attributes["moriio_fsm.request.id"] == request_id
        assert attributes["moriio_fsm.role"] == role
        assert attributes["moriio_fsm.outcome"] == outcome
        assert attributes["moriio_fsm.anomalies"] == []
    d_children = children_of(spans, d_span)
    assert [c["name"] for c in d_children] == [
        "watch_consumer.load_requested",
        "watch_consumer.blocks_allocated",
        "watch_consumer.loading",
        "watch_consumer.received",
    ]
    assert [c["name"] for c in children_of(spans, p_span)] == [
        "watch_producer.prefilling",
        "watch_producer.held",
    ]
    # The children tile the parent: each starts where the one before ended.
    assert d_children[0]["start"] == d_span["start"] and d_children[-1]["end"] == d_span["end"]
    assert all(a["end"] == b["start"] for a, b in zip(d_children, d_children[1:]))


def test_an_anomaly_is_on_the_span_and_marks_it_failed(make_watched, otlp):  # noqa: F811
    from vllm.v1.outputs import KVConnectorOutput

    p, _ = _watched_pair(make_watched, "tx-ok")
    # D's load fails (failed_recving), then its request is aborted and reported.
    d2 = make_watched("D2", "kv_consumer", otel=True)
    _, to_d = write_pair_params("tx-lost", p, d2)
    d2.add("req-lost", PROMPT, 4, to_d, trace_headers=CLIENT)
    d2.step()
    d2.step()
    d2.scheduler.connector.update_connector_output(KVConnectorOutput(failed_recving={"req-lost"}))
    d2.abort("req-lost")
    d2.scheduler.connector.update_connector_output(KVConnectorOutput(finished_recving={"req-lost"}))
    otlp.export.flush()
    spans = otlp.wait_for(
        lambda s: any(
            x["attributes"].get("moriio_fsm.transfer.key") == "tx-lost"
            for x in named(s, "watch_consumer")
        )
    )
    (lost,) = [
        s
        for s in named(spans, "watch_consumer")
        if s["attributes"]["moriio_fsm.transfer.key"] == "tx-lost"
    ]
    assert "load_error" in lost["attributes"]["moriio_fsm.anomalies"]
    assert lost["status"] == 2  # STATUS_CODE_ERROR
    assert lost["trace_id"] == W3C_TRACE_ID


def test_the_projects_connector_sends_the_same_shape(make_instance, otlp):  # noqa: F811
    p, d = _pair(lambda n, r, o: make_instance(n, r, extra={"otel": o}), True, "tx-own", CLIENT)
    spans = _spans(otlp, ["write_producer", "write_consumer"])
    for machine, instance, request_id, role in (
        ("write_producer", p, "req-p", "producer"),
        ("write_consumer", d, "req-d", "consumer"),
    ):
        (span,) = named(spans, machine)
        assert span["trace_id"] == W3C_TRACE_ID and span["parent_span_id"] == W3C_SPAN_ID
        attributes = span["attributes"]
        assert attributes["moriio_fsm.transfer.key"] == "tx-own"
        assert attributes["moriio_fsm.request.id"] == request_id
        assert attributes["moriio_fsm.role"] == role
        path = _path(instance.worker._worker.recorder.records("tx-own"))
        assert attributes["moriio_fsm.outcome"] == path[-1]
        assert [c["name"] for c in children_of(spans, span)] == [
            f"{machine}.{state}" for state in path[:-1]
        ]


def test_a_request_without_trace_headers_gets_a_trace_of_its_own(make_watched, otlp):  # noqa: F811
    _watched_pair(make_watched, "tx-root", headers={"traceparent": "00-zz-bad-01"})
    spans = _spans(otlp, ["watch_producer", "watch_consumer"])
    for machine in ("watch_producer", "watch_consumer"):
        (span,) = named(spans, machine)
        assert span["parent_span_id"] == "" and span["trace_id"] != W3C_TRACE_ID
        assert len(children_of(spans, span)) >= 2


def _silent_collector():
    """A listener that accepts connections and never answers (a hung collector)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    return server


def test_a_collector_that_never_answers_changes_nothing(make_watched, monkeypatch, caplog):
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    from moriio_fsm.trace import otel_export

    hung, refused = _silent_collector(), socket.socket()
    refused.bind(("127.0.0.1", 0))  # bound, not listening: connections are refused
    try:
        for target in (hung, refused):
            port = target.getsockname()[1]
            export = otel_export.SpanExport(
                OTLPSpanExporter(endpoint=f"http://127.0.0.1:{port}/v1/traces", timeout=1)
            )
            monkeypatch.setattr(otel_export, "_export", export)
            monkeypatch.setattr(otel_export, "_pid", os.getpid())
            tid = f"tx-down-{port}"
            with caplog.at_level(logging.WARNING, logger="moriio_fsm.otel"):
                for round_ in range(3):
                    p, d = _watched_pair(make_watched, f"{tid}-{round_}")
                    assert len(d.outputs["req-d"]) == 4 and d.empty() and p.empty()
                export.processor.force_flush()
            failures = [r for r in caplog.records if "otel.export_failed" in r.getMessage()]
            assert len(failures) == 1
            export.close(timeout_s=0.5)
            caplog.clear()
    finally:
        hung.close()
        refused.close()


def test_off_by_default_no_exporter_thread_and_no_sdk_import(tmp_path):
    script = textwrap.dedent(
        f"""
        import sys, threading
        sys.path[:0] = [{str(Path(__file__).parent)!r}]
        from harness import model_dir, run_until, write_pair_params, Instance
        from watch_harness import WatchInstance
        import pathlib
        model = model_dir(pathlib.Path({str(tmp_path)!r}))
        for kind in (Instance, WatchInstance):
            p = kind("P", "kv_producer", False, model)
            d = kind("D", "kv_consumer", False, model)
            to_p, to_d = write_pair_params("tx-" + kind.__name__, p, d)
            h = {{"traceparent": {TRACEPARENT!r}}}
            p.add("req-p", list(range(10, 50)), 1, to_p, trace_headers=h)
            d.add("req-d", list(range(10, 50)), 4, to_d, trace_headers=h)
            assert run_until([p, d], lambda: p.empty() and d.empty() and d.outputs)
            p.close(); d.close()
        # (vLLM itself may import the API and the exporters' namespace packages.)
        loaded = sorted(m for m in sys.modules if m.startswith(("opentelemetry.sdk",
                        "opentelemetry.exporter.otlp.proto.http",
                        "opentelemetry.exporter.otlp.proto.grpc", "moriio_fsm.trace.otel")))
        threads = sorted(t.name for t in threading.enumerate() if "span" in t.name.lower()
                         or t.name.startswith("OtelBatch"))
        print("LOADED", loaded, "THREADS", threads)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "LOADED [] THREADS []" in done.stdout


def test_the_otel_setting_is_checked(tiny_model):
    from moriio_fsm.vllm.settings import ConnectorConfigError, ConnectorSettings

    with pytest.raises(ConnectorConfigError, match="otel"):
        ConnectorSettings.from_extra_config({"otel": "yes"})
    with pytest.raises(ConnectorConfigError, match="otel"):
        WatchInstance("P", "kv_producer", False, tiny_model, watch={"otel": 1})

"""The connector's metrics as vLLM consumes them, and a shutdown that leaves nothing running.

Stats travel as a plain dict from each worker, are rebuilt with
``build_kv_connector_stats``, aggregated and reduced to vLLM's log line; Prometheus
metrics are fed by ``observe``. After ``shutdown`` no thread of the connector runs and
its ports can be bound again.
"""

from __future__ import annotations

import functools
import pickle
import socket
import threading

import pytest
from harness import PROMPT_FOR_METRICS, run_until, write_pair_params
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from moriio_fsm.vllm.connector import MoRIIOFSMConnector
from moriio_fsm.vllm.metrics import FsmConnectorStats

pytestmark = pytest.mark.integration


def one_transfer(make_instance):
    P, D = make_instance("P", "kv_producer"), make_instance("D", "kv_consumer")
    to_p, to_d = write_pair_params("tx-m1", P, D)
    P.add("p-1", PROMPT_FOR_METRICS, 1, to_p)
    D.add("d-1", PROMPT_FOR_METRICS, 3, to_d)
    assert run_until([P, D], lambda: len(D.outputs.get("d-1", [])) >= 3 and P.empty() and D.empty())
    return P, D


def test_stats_count_the_transfer_and_survive_vllms_round_trip(make_instance):
    P, D = one_transfer(make_instance)
    p_stats, d_stats = P.worker.get_kv_connector_stats(), D.worker.get_kv_connector_stats()
    for stats in (p_stats, d_stats):
        assert isinstance(stats, FsmConnectorStats)
        assert stats.data["transfers"] == {"completed": 1}
        assert len(stats.data["transfer_time_s"]) == 1 and stats.data["transfer_time_s"][0] > 0
    assert sum(p_stats.data["bytes"]) > 0  # P posted the writes
    assert any(k.startswith("write_consumer.waiting") for k in d_stats.data["state_time_s"])
    # Only the data dict crosses processes; vLLM rebuilds the object from it.
    rebuilt = MoRIIOFSMConnector.build_kv_connector_stats(pickle.loads(pickle.dumps(p_stats.data)))
    merged = rebuilt.aggregate(MoRIIOFSMConnector.build_kv_connector_stats(d_stats.data))
    line = merged.reduce()
    assert line["transfers_completed"] == 2 and line["transfers_failed"] == 0
    assert line["transfer_time_p50_ms"] > 0 and line["bytes"] == sum(p_stats.data["bytes"])
    # The interval was handed over: the next one starts empty.
    assert P.worker.get_kv_connector_stats() is None
    assert MoRIIOFSMConnector.build_kv_connector_stats().is_empty()


def test_prometheus_metrics_are_named_the_vllm_way(make_instance):
    P, D = one_transfer(make_instance)
    registry = CollectorRegistry()
    kinds = {cls: functools.partial(cls, registry=registry) for cls in (Counter, Gauge, Histogram)}
    prom = MoRIIOFSMConnector.build_prom_metrics(
        D.config, kinds, ["model_name", "engine"], {0: ["tiny", "0"]}
    )
    prom.observe(D.worker.get_kv_connector_stats().data, 0)
    labels = {"model_name": "tiny", "engine": "0"}
    assert (
        registry.get_sample_value(
            "vllm:moriio_fsm_transfers_total", {**labels, "outcome": "completed"}
        )
        == 1
    )
    assert registry.get_sample_value("vllm:moriio_fsm_transfer_time_seconds_count", labels) == 1
    states = {
        s.labels["state"]
        for m in registry.collect()
        for s in m.samples
        if m.name == "vllm:moriio_fsm_state_time_seconds" and "state" in s.labels
    }
    assert "write_consumer.waiting" in states


def test_shutdown_stops_every_thread_and_frees_every_port(make_instance):
    P, D = one_transfer(make_instance)
    ports = [P.notify_port, P.handshake_port, D.notify_port, D.handshake_port]
    P.close()
    D.close()
    P.close()  # idempotent
    names = [t.name for t in threading.enumerate() if t.is_alive()]
    assert not [n for n in names if n.startswith(("moriio", "cross-memory"))], names
    for port in ports:
        with socket.socket() as sock:
            # As a restarted server binds (connections of the old one may linger in
            # TIME_WAIT): this fails only while something still listens on the port.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("127.0.0.1", port))
            sock.listen()


def test_the_connectors_warnings_go_where_vllms_own_records_go(make_instance):
    """Inside a vLLM server the package's NullHandler would hide every warning: the
    connector shares the handlers vLLM configured for its own logger, at vLLM's level."""
    import io
    import logging

    stream = io.StringIO()
    served = logging.StreamHandler(stream)
    vllm_logger, ours = logging.getLogger("vllm"), logging.getLogger("moriio_fsm")
    kept = (list(ours.handlers), ours.level, ours.propagate)
    vllm_logger.addHandler(served)  # what vLLM's logging set-up does in a server
    try:
        make_instance("D", "kv_consumer")
        from moriio_fsm.logs import get_logger

        get_logger("moriio_fsm.vllm").warning("vllm.transfer_id_in_use", transfer_id="tx-1")
        assert "vllm.transfer_id_in_use transfer_id='tx-1'" in stream.getvalue()
        get_logger("moriio_fsm.vllm").debug("vllm.message_dropped")
        assert "message_dropped" not in stream.getvalue()  # vLLM's level holds
    finally:
        vllm_logger.removeHandler(served)
        ours.handlers[:], ours.level, ours.propagate = kept

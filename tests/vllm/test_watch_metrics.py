"""The watch's metrics, the vLLM way: its stats cross processes as plain data beside the inner
connector's (whose log line and metrics stay its own), and Prometheus shows them under fixed
names dashboards can rely on."""

from __future__ import annotations

import functools
import pickle

import pytest
from harness import run_until, write_pair_params
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from watch_harness import WatchInstance

from moriio_fsm.vllm.metrics import FsmConnectorStats
from moriio_fsm.vllm.watch import WatchConnector
from moriio_fsm.vllm.watch_metrics import ANOMALY_KINDS

PROMPT = list(range(10, 50))


def metric_types(registry):
    return {
        kind: functools.partial(kind, registry=registry) for kind in (Counter, Gauge, Histogram)
    }


@pytest.fixture
def pair(tiny_model):
    p = WatchInstance("P", "kv_producer", False, tiny_model)
    d = WatchInstance("D", "kv_consumer", False, tiny_model)
    yield p, d
    p.close()
    d.close()


def run_one(p, d):
    """One transfer; returns D's stats data gathered the way vLLM's scheduler gathers it."""
    to_p, to_d = write_pair_params("tx-m", p, d)
    p.add("req-p", PROMPT, 1, to_p)
    d.add("req-d", PROMPT, 3, to_d)
    gathered = []
    original = d.scheduler_connector.get_kv_connector_stats

    def spy():
        stats = original()
        if stats is not None:
            gathered.append(pickle.loads(pickle.dumps(stats.data)))  # crosses processes
        return stats

    d.scheduler_connector.get_kv_connector_stats = spy
    assert run_until([p, d], lambda: d.empty() and len(d.outputs.get("req-d", [])) == 3)
    merged = WatchConnector.build_kv_connector_stats(gathered[0])
    for data in gathered[1:]:
        merged = merged.aggregate(WatchConnector.build_kv_connector_stats(data))
    return merged


def test_prometheus_shows_the_watch_under_its_fixed_names(pair):
    p, d = pair
    stats = run_one(p, d)
    d.scheduler_connector.update_connector_output(
        type("Output", (), {"finished_recving": {"nobody"}})()
    )
    stats = stats.aggregate(d.scheduler_connector.get_kv_connector_stats())
    registry = CollectorRegistry()
    prom = WatchConnector.build_prom_metrics(
        d.config, metric_types(registry), ["model_name", "engine"], {0: ["tiny", "0"]}
    )
    prom.observe(stats.data, 0)
    text = generate_latest(registry).decode()
    assert (
        'vllm:moriio_fsm_watch_transfers_total{engine="0",model_name="tiny",outcome="received",'
        'role="consumer"} 1.0' in text
    )
    assert (
        'vllm:moriio_fsm_watch_anomalies_total{engine="0",kind="unexpected_report",'
        'model_name="tiny"} 1.0' in text
    )
    assert 'vllm:moriio_fsm_watch_stuck_transfers{engine="0",model_name="tiny"} 0.0' in text
    assert 'vllm:moriio_fsm_watch_state_seconds_count{engine="0",model_name="tiny",' in text
    assert 'state="watch_consumer.loading"' in text
    # The inner connector's own metrics are fed its own data, under its own names.
    assert "vllm:moriio_fsm_transfers_total" in text


def test_the_log_line_keeps_the_inner_connectors_figures_and_adds_the_watchs(pair):
    p, d = pair
    worker = d.worker.get_kv_connector_stats  # the workers' stats: the inner connector's
    stats = run_one(p, d)
    from_workers = worker()
    assert from_workers.data["inner"]["transfers"] == {"completed": 1}
    stats = from_workers.aggregate(stats)  # as vLLM's scheduler joins them
    line = stats.reduce()
    inner = FsmConnectorStats(data=dict(from_workers.data["inner"])).reduce()
    assert inner["transfers_completed"] == 1
    for key, value in inner.items():
        assert line[key] == value
    assert line["watch_transfers_consumer_received"] == 1
    assert line["watch_stuck_transfers"] == 0
    assert not stats.is_empty()


def test_the_anomaly_kinds_are_the_documented_five():
    assert ANOMALY_KINDS == (
        "stuck_load",
        "stranded_kv",
        "unexpected_report",
        "second_report",
        "load_error",
    )

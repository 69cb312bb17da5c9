"""The watch under hostile input: ill-typed kv_transfer_params, reports for unknown ids, floods
and threads racing. vLLM's calls always get the inner connector's answers; the watch counts
what it saw, keeps its memory and its log bounded, and never raises."""

from __future__ import annotations

import logging
import threading

import pytest
from harness import run_until, write_pair_params
from vllm.v1.outputs import KVConnectorOutput
from watch_harness import WatchInstance

from moriio_fsm.vllm import watch_keys
from moriio_fsm.vllm.watch_anomalies import LOG_FIRST

PROMPT = list(range(10, 50))


@pytest.fixture
def decode(tiny_model):
    instance = WatchInstance("D", "kv_consumer", False, tiny_model)
    yield instance
    instance.close()


@pytest.mark.parametrize(
    "params",
    [
        {"do_remote_prefill": True, "transfer_id": 12},
        {"do_remote_prefill": True, "transfer_id": "x" * 100_000},
        {"do_remote_prefill": True, "transfer_id": None, "remote_request_id": ["a"]},
        {"do_remote_decode": "yes"},
    ],
)
def test_ill_typed_params_change_nothing_vllm_sees(decode, params):
    # The inner connector refuses or ignores such a request; the watch must not add to it.
    request = decode.add("req-junk", PROMPT, 2, params)
    connector = decode.scheduler_connector
    before = connector.inner.get_num_new_matched_tokens(request, 0)
    assert connector.get_num_new_matched_tokens(request, 0) == before
    assert connector._watch_failures == 0


def test_a_flood_of_unknown_reports_is_counted_in_full_and_logged_in_part(decode, caplog):
    connector = decode.scheduler_connector
    ids = {f"junk-{n}" for n in range(5000)}
    with caplog.at_level(logging.WARNING, logger="moriio_fsm.vllm.watch"):
        assert connector.update_connector_output(KVConnectorOutput(finished_recving=ids)) is None
    assert decode.watch_counts["unexpected_report"] == 5000
    logged = [r for r in caplog.records if "unexpected_report" in r.getMessage()]
    assert LOG_FIRST <= len(logged) <= LOG_FIRST + 5
    assert len(connector.scheduler_watch.keys) == 0  # reports bind nothing
    assert connector._watch_failures == 0


def test_the_id_table_is_bounded(monkeypatch):
    keys = watch_keys.RequestKeys(capacity=100)
    for n in range(1000):
        keys.bind(f"r{n}", f"k{n}")
    assert len(keys) == 100
    assert keys.key_of("r999") == "k999" and keys.key_of("r0") == "r0"
    assert keys.request_of("k0") == "" and keys.request_of("k999") == "r999"


def test_odd_objects_in_the_connector_output_are_ignored(decode):
    connector = decode.scheduler_connector
    odd = KVConnectorOutput(finished_recving={("a", 1)}, invalid_block_ids={"x", 3.5, -1})
    assert connector.update_connector_output(odd) is None
    assert connector._watch_failures == 0


def test_threads_racing_on_hooks_and_timers_lose_no_count(tiny_model):
    p = WatchInstance("P", "kv_producer", False, tiny_model)
    d = WatchInstance("D", "kv_consumer", False, tiny_model)
    try:
        to_p, to_d = write_pair_params("tx-race", p, d)
        p.add("req-p", PROMPT, 1, to_p)
        d.add("req-d", PROMPT, 3, to_d)
        connector = d.scheduler_connector
        errors = []

        def flood(thread: int) -> None:
            try:
                for n in range(300):
                    connector.update_connector_output(
                        KVConnectorOutput(finished_sending={f"t{thread}-{n}"})
                    )
                    watch = connector.scheduler_watch
                    watch._settled("consumer", watch.drivers["consumer"].advance())
            except Exception as exc:  # any is a failure of the test
                errors.append(exc)

        threads = [threading.Thread(target=flood, args=(t,)) for t in range(4)]
        for thread in threads:
            thread.start()
        done = run_until([p, d], lambda: len(d.outputs.get("req-d", [])) == 3)
        for thread in threads:
            thread.join(timeout=60)
        assert done and not errors
        assert d.watch_counts["unexpected_report"] == 1200
        assert "stuck_load" not in d.watch_counts and "second_report" not in d.watch_counts
        assert connector._watch_failures == 0
    finally:
        p.close()
        d.close()

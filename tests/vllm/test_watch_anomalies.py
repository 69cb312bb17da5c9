"""Every anomaly the watch reports, provoked through real hook calls: vLLM's real scheduler
(real Request and SchedulerOutput objects) driving ``WatchConnector`` around the project's
own connector. Deadlines are reached by advancing the watch machines' clock, not by waiting."""

from __future__ import annotations

import logging

import pytest
from harness import NUM_BLOCKS, run_until, write_pair_params
from vllm.v1.outputs import KVConnectorOutput
from watch_harness import WatchInstance

PROMPT = list(range(10, 50))


@pytest.fixture
def make_watched(tiny_model):
    made = []

    def make(name, kv_role, **watch):
        instance = WatchInstance(name, kv_role, False, tiny_model, watch=watch)
        made.append(instance)
        return instance

    yield make
    for instance in made:
        instance.close()


def watch_of(instance):
    return instance.scheduler_connector.scheduler_watch


def past_deadline(instance, role: str, seconds: float) -> None:
    """Fire the watch machines' timers as if ``seconds`` had passed."""
    watch = watch_of(instance)
    driver = watch.drivers[role]
    watch._settled(role, driver.advance(watch.clock() + seconds))


def clean_pair(make_watched, tid="tx-clean", max_tokens=4):
    p, d = make_watched("P", "kv_producer"), make_watched("D", "kv_consumer")
    to_p, to_d = write_pair_params(tid, p, d)
    p.add("req-p", PROMPT, 1, to_p)
    d.add("req-d", PROMPT, max_tokens, to_d)
    assert run_until([p, d], lambda: len(d.outputs.get("req-d", [])) == max_tokens)
    return p, d


def test_a_clean_transfer_reports_no_anomaly_and_ends_on_both_sides(make_watched):
    p, d = clean_pair(make_watched)
    assert run_until([p, d], lambda: p.empty() and d.empty())
    assert dict(p.watch_counts) == {} and dict(d.watch_counts) == {}
    assert watch_of(d).tables["consumer"].state_of("tx-clean") == "released"
    steps = [s.after for s in watch_of(d).recorder.records("tx-clean")]
    assert steps == ["load_requested", "blocks_allocated", "loading", "received"] + [
        "received",
        "released",
    ]
    assert watch_of(p).tables["producer"].state_of("tx-clean") == "sent"


def test_a_load_past_its_deadline_is_stuck_once_with_its_path_and_the_gauge(make_watched, caplog):
    d = make_watched("D", "kv_consumer", stuck_after_s=5.0)
    absent = make_watched("P", "kv_producer")  # never given the request: nothing is sent
    _, to_d = write_pair_params("tx-stuck", absent, d)
    d.add("req-stuck", PROMPT, 4, to_d)
    for _ in range(3):
        d.step()
    assert watch_of(d).tables["consumer"].state_of("tx-stuck") == "loading"
    with caplog.at_level(logging.WARNING, logger="moriio_fsm.vllm.watch"):
        past_deadline(d, "consumer", 6.0)
        past_deadline(d, "consumer", 60.0)
    assert d.watch_counts["stuck_load"] == 1
    assert watch_of(d).metrics.stuck_now() == 1
    lines = [r.getMessage() for r in caplog.records if "stuck_load" in r.getMessage()]
    assert len(lines) == 1
    assert "tx-stuck" in lines[0] and "req-stuck" in lines[0]
    assert "load_requested" in lines[0] and "-> loading" in lines[0]
    effects = [e for s in watch_of(d).recorder.records("tx-stuck") for e in s.effects]
    assert any(e.get("anomaly") == "stuck_load" for e in effects)  # dumped to the trace
    assert not d.outputs.get("req-stuck")  # nothing was rescued: the request still waits


def test_blocks_held_for_sending_past_their_deadline_are_stranded(make_watched):
    p = make_watched("P", "kv_producer", stranded_after_s=5.0)
    silent = make_watched("D", "kv_consumer")  # never asks for the KV
    to_p, _ = write_pair_params("tx-stranded", p, silent)
    p.add("req-p", PROMPT, 1, to_p)
    assert run_until([p], lambda: p.outputs.get("req-p"))
    assert watch_of(p).tables["producer"].state_of("tx-stranded") == "held"
    past_deadline(p, "producer", 6.0)
    assert p.watch_counts["stranded_kv"] == 1
    assert watch_of(p).metrics.stuck_now() == 1
    held = p.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
    assert held < NUM_BLOCKS - 1  # the watch freed nothing: the blocks are still held


def test_a_report_for_a_request_never_seen_is_unexpected(make_watched):
    d = make_watched("D", "kv_consumer")
    connector = d.scheduler_connector
    answer = connector.update_connector_output(
        KVConnectorOutput(finished_recving={"nobody"}, finished_sending={"nobody-p"})
    )
    assert answer is None
    assert d.watch_counts["unexpected_report"] == 2


def test_a_report_after_the_transfer_ended_is_unexpected(make_watched):
    p, d = clean_pair(make_watched, tid="tx-ended")
    assert run_until([p, d], lambda: d.empty())
    d.scheduler_connector.update_connector_output(KVConnectorOutput(finished_recving={"req-d"}))
    assert d.watch_counts["unexpected_report"] == 1
    late = [s for s in watch_of(d).recorder.records("tx-ended") if s.outcome == "late"]
    assert late and late[0].event == "recv_reported"


def test_a_report_for_a_load_not_waiting_yet_is_unexpected(make_watched):
    d = make_watched("D", "kv_consumer")
    absent = make_watched("P", "kv_producer")
    _, to_d = write_pair_params("tx-early", absent, d)
    request = d.add("req-early", PROMPT, 4, to_d)
    connector = d.scheduler_connector
    count, load_async = connector.get_num_new_matched_tokens(request, 0)
    assert load_async is True and count > 0
    connector.update_connector_output(KVConnectorOutput(finished_recving={"req-early"}))
    assert d.watch_counts["unexpected_report"] == 1


def test_a_send_reported_while_the_prefill_runs_is_unexpected(make_watched):
    p = make_watched("P", "kv_producer")
    silent = make_watched("D", "kv_consumer")
    to_p, _ = write_pair_params("tx-running", p, silent)
    p.add("req-running", PROMPT, 8, to_p)
    p.step()
    assert watch_of(p).tables["producer"].state_of("tx-running") == "prefilling"
    p.scheduler_connector.update_connector_output(
        KVConnectorOutput(finished_sending={"req-running"})
    )
    assert p.watch_counts["unexpected_report"] == 1


def test_a_second_send_report_is_counted_once_as_second(make_watched):
    p, d = clean_pair(make_watched, tid="tx-twice")
    assert run_until([p, d], lambda: p.empty())
    for _ in range(3):
        p.scheduler_connector.update_connector_output(KVConnectorOutput(finished_sending={"req-p"}))
    assert p.watch_counts["second_report"] == 1
    assert "unexpected_report" not in p.watch_counts


def test_a_second_load_report_while_the_request_runs_is_second(make_watched):
    p, d = clean_pair(make_watched, tid="tx-again", max_tokens=2)
    d.add("req-long", PROMPT, 30, write_pair_params("tx-long", p, d)[1])
    p.add("req-long-p", PROMPT, 1, write_pair_params("tx-long", p, d)[0])
    assert run_until([p, d], lambda: len(d.outputs.get("req-long", [])) >= 2)
    assert watch_of(d).tables["consumer"].state_of("tx-long") == "received"
    d.scheduler_connector.update_connector_output(KVConnectorOutput(finished_recving={"req-long"}))
    assert d.watch_counts["second_report"] == 1


def test_blocks_that_failed_to_load_are_a_load_error_of_the_load_they_belong_to(make_watched):
    d = make_watched("D", "kv_consumer")
    absent = make_watched("P", "kv_producer")
    _, to_d = write_pair_params("tx-bad", absent, d)
    d.add("req-bad", PROMPT, 4, to_d)
    d.step()
    blocks = d.scheduler.kv_cache_manager.get_block_ids("req-bad")[0]
    d.scheduler_connector.update_connector_output(
        KVConnectorOutput(invalid_block_ids={NUM_BLOCKS + 5})  # no load's block: nothing
    )
    assert "load_error" not in d.watch_counts
    d.scheduler_connector.update_connector_output(KVConnectorOutput(invalid_block_ids={blocks[0]}))
    assert d.watch_counts["load_error"] == 1
    assert watch_of(d).tables["consumer"].state_of("tx-bad") == "load_failed"

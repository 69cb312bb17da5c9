"""The recorder: one record per dispatch with what it did, bounded rings, threads, tracing off."""

from __future__ import annotations

import threading

from moriio_fsm.machines import build_table
from moriio_fsm.runtime.declared import events
from moriio_fsm.trace import TraceRecorder, replay

from .conftest import lifecycle as _lifecycle


def test_each_dispatch_is_recorded_with_state_before_rows_actions_and_effects():
    recorder = TraceRecorder("P0")
    table = build_table("write_producer", recorder=recorder)
    _lifecycle(table, "tx-1", layers=1)
    steps = recorder.records("tx-1")
    assert [s.event for s in steps] == [
        "prefill_started",
        "remote_blocks",
        "layer_scheduled",
        "seal",
        "layer_write_completed",
        "request_finished",
    ]
    assert [s.seq for s in steps] == sorted(s.seq for s in steps)
    first, scheduled, last_write = steps[0], steps[2], steps[4]
    assert (first.before, first.after, first.outcome) == (None, "allocated", "created")
    assert first.actions == ["init_transfer"]
    assert scheduled.effects == [
        {"kind": "post_write", "layer": 0, "block_ids": [1, 2], "decode_rank": 0}
    ]
    # The last completion runs its own row and the eventless one that tells D write_done.
    assert last_write.actions == ["count_completion", "tell_write_done"]
    assert [e["kind"] for e in last_write.effects] == ["send_write_done"]
    assert (last_write.before, last_write.after) == ("sealed", "completed")
    assert steps[-1].after == "released" and steps[-1].pid and steps[-1].thread == "MainThread"


def test_rings_stay_bounded_globally_and_per_transfer():
    recorder = TraceRecorder("P0", ring=50, per_transfer=5, ended=3)
    table = build_table("write_producer", recorder=recorder)
    for i in range(20):
        _lifecycle(table, f"tx-{i}", layers=8)
    assert len(recorder.records()) == 50
    assert [s.event for s in recorder.records("tx-19")][-1] == "request_finished"
    assert len(recorder.records("tx-19")) == 5
    assert recorder.records("tx-0") == []  # ended long ago: not kept
    assert recorder.stats()["live_transfers"] == 0


def test_a_flood_of_unknown_ids_keeps_no_transfer_ring():
    recorder = TraceRecorder("P0", ring=100)
    table = build_table("write_producer", recorder=recorder)
    for i in range(5000):
        table.dispatch(events.release(f"junk-{i}", 0.0, source="flooder"))
    stats = recorder.stats()
    assert stats["kept"] == 100 and stats["live_transfers"] == 0


def test_threads_racing_on_one_recorder_lose_and_reorder_nothing(tmp_path):
    recorder = TraceRecorder("P0", file=tmp_path / "race.jsonl", queue_limit=1 << 20)
    tables = [build_table("write_producer", recorder=recorder) for _ in range(2)]
    errors = []

    def worker(n: int) -> None:
        try:
            for i in range(40):
                _lifecycle(tables[n % 2], f"tx-{n}-{i}", layers=4)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    recorder.close()
    assert not errors
    report = replay([tmp_path / "race.jsonl"])
    assert report.steps == 4 * 40 * 12
    assert report.ok, (report.divergences[:1], report.anomalies[:1])
    assert len({(s.table, s.transfer) for s in report.transfers.values()}) == 160


def test_tracing_off_runs_the_plain_steps_and_a_recorder_can_come_and_go():
    table = build_table("write_producer")
    plain = table.generated.source
    assert "shard.fired" not in plain
    recorder = TraceRecorder("P0")
    table.recorder = recorder
    assert "shard.fired" in table.generated.source
    _lifecycle(table, "tx-1")
    table.recorder = None
    assert table.generated.source == plain
    _lifecycle(table, "tx-2")
    assert {s.transfer for s in recorder.records()} == {"tx-1"}
    assert table.state_of("tx-2") == "released"


def test_a_step_recorder_that_raises_never_costs_the_step():
    class Broken:
        def bind_table(self, table):
            def record(ev, before, result, rows, error=None):
                raise RuntimeError("disk on fire")

            return record

    table = build_table("write_producer", recorder=Broken())
    _lifecycle(table, "tx-1")
    assert table.state_of("tx-1") == "released"
    assert table.stats()["recorder_errors"] == 8


def test_timer_firings_are_recorded_and_replay(tmp_path):
    recorder = TraceRecorder("P0", file=tmp_path / "t.jsonl")
    table = build_table("write_producer", recorder=recorder)
    table.dispatch(events.prefill_started("tx-1", 0.0, num_writers=1))
    table.dispatch(events.layer_scheduled("tx-1", 0.1, 0))
    table.dispatch(events.seal("tx-1", 0.2))
    table.advance(120.0)  # D's allocation never came: the defer timer fires
    recorder.close()
    last = recorder.records("tx-1")[-1]
    assert (last.event, last.before, last.after) == ("defer_timeout", "sealed", "closing")
    report = replay([tmp_path / "t.jsonl"])
    assert not report.divergences
    assert [(a.kind, a.transfer) for a in report.anomalies] == [("not_final", "tx-1")]

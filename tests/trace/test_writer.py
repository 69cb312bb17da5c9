"""The background writer: never on the dispatching thread, rotation, failing disks, floods, dumps."""

from __future__ import annotations

import threading

from moriio_fsm.machines import build_table
from moriio_fsm.trace import TraceRecorder, TraceWriter, iter_records, read_trace, replay
from moriio_fsm.trace.format import Header

from .conftest import lifecycle


def _lifecycle(table, tid: str) -> None:
    lifecycle(table, tid, layers=4)


def test_lines_are_rendered_and_written_on_the_writer_thread_only(tmp_path, monkeypatch):
    seen_threads = set()
    original = TraceWriter._write

    def spy(self, lines):
        seen_threads.add(threading.get_ident())
        return original(self, lines)

    monkeypatch.setattr(TraceWriter, "_write", spy)
    recorder = TraceRecorder("P0", file=tmp_path / "t.jsonl")
    table = build_table("write_producer", recorder=recorder)
    _lifecycle(table, "tx-1")
    recorder.close()
    assert seen_threads and threading.get_ident() not in seen_threads
    assert seen_threads == {recorder.writer.thread.ident}
    assert len(read_trace(tmp_path / "t.jsonl").steps) == 12


def test_rotation_keeps_backups_and_every_part_reads_alone(tmp_path):
    path = tmp_path / "t.jsonl"
    recorder = TraceRecorder("P0", file=path, max_bytes=8192, backups=2)
    table = build_table("write_producer", recorder=recorder)
    for i in range(40):
        _lifecycle(table, f"tx-{i}")
        recorder.flush()
    recorder.close()
    parts = sorted(tmp_path.iterdir())
    assert [p.name for p in parts] == ["t.jsonl", "t.jsonl.1", "t.jsonl.2"]
    for part in parts:
        assert part.stat().st_size <= 8192 + 2048  # one line may cross the mark
        records = [r for _, r in iter_records(part)]
        assert isinstance(records[0], Header)
        assert records[1].__class__.__name__ == "TableInfo"  # each part describes its table
    headers = [next(iter(iter_records(p)))[1] for p in parts]
    assert sorted(h.part for h in headers) == sorted({h.part for h in headers})
    report = replay(parts)
    assert not report.divergences and report.steps > 0
    # Transfers whose start was rotated away are partial, not failures.
    assert all(s.partial or s.state == "released" for s in report.transfers.values())


def test_a_failing_disk_never_reaches_the_dispatching_thread(tmp_path):
    writer = TraceWriter("/dev/full", flush_interval=0.01)  # every write: no space left
    recorder = TraceRecorder("P0", file=writer)
    table = build_table("write_producer", recorder=recorder)
    for i in range(20):
        _lifecycle(table, f"tx-{i}")
    writer.flush()
    writer.close()
    assert all(table.state_of(f"tx-{i}") == "released" for i in range(20))
    stats = writer.stats()
    assert stats["write_errors"] >= 1 and stats["dropped"] > 0 and stats["written"] == 0


def test_a_flood_beyond_the_queue_is_dropped_counted_and_marked_as_a_gap(tmp_path):
    path = tmp_path / "t.jsonl"
    gate = threading.Event()
    writer = TraceWriter(path, queue_limit=30, flush_interval=0.01)
    drain = writer._drain

    def held_drain():  # the disk is slow: nothing drains until the gate
        gate.wait(30)
        drain()

    writer._drain = held_drain
    recorder = TraceRecorder("P0", file=writer)
    table = build_table("write_producer", recorder=recorder)
    for i in range(10):
        _lifecycle(table, f"tx-{i}")  # 120 steps into a queue of 30
    assert len(writer._queue) <= 30 and writer.dropped == 90
    gate.set()
    writer.close()
    trace = read_trace(path)
    assert len(trace.steps) == 30 and [g.dropped for g in trace.gaps] == [90]
    report = replay([path])
    assert any(a.kind == "gap" for a in report.anomalies)


def test_dump_on_anomaly_keeps_only_the_transfers_that_ended_badly(demo_trace, tmp_path):
    from moriio_fsm.scenarios import run as run_demo

    dump = tmp_path / "dump.jsonl"
    recorder = TraceRecorder("demo", dump=dump)
    run_demo(recorder=recorder)
    recorder.close()
    dumped = {s.transfer for s in read_trace(dump).steps}
    assert dumped == {
        "tx-demo-failed_write",
        "tx-demo-defer_timeout",
        "tx-demo-stalled_write",
        "tx-demo-unconfirmed_teardown",
    }
    report = replay([dump])
    assert not report.divergences
    assert [a.kind for a in report.anomalies] == ["anomaly_state"]

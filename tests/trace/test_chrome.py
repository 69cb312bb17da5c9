"""export-trace: Chrome trace event JSON that Perfetto can load."""

from __future__ import annotations

import json

from moriio_fsm.cli import main


def _check_structure(data: dict) -> dict:
    assert isinstance(data, dict) and isinstance(data["traceEvents"], list)
    open_spans: dict = {}
    for event in data["traceEvents"]:
        assert {"name", "ph", "pid", "tid"} <= set(event), event
        assert event["ph"] in ("M", "b", "e", "n"), event
        if event["ph"] == "M":
            assert event["name"] == "process_name" and event["args"]["name"]
            continue
        assert isinstance(event["ts"], (int, float)) and event["ts"] >= 0
        key = (event["cat"], event["id"])
        stack = open_spans.setdefault(key, [])
        if event["ph"] == "b":
            stack.append((event["name"], event["ts"]))
        elif event["ph"] == "e":
            name, started = stack.pop()  # every "e" closes the innermost "b"
            assert name == event["name"] and event["ts"] >= started
        else:
            assert stack, f"an instant outside its transfer's span: {event}"
    assert all(not stack for stack in open_spans.values()), "a 'b' left without its 'e'"
    return open_spans


def test_the_export_is_structurally_valid_and_closes_every_span(stuck_trace, tmp_path, capsys):
    out = tmp_path / "trace.json"
    assert main(["export-trace", *map(str, stuck_trace), "-o", str(out)]) == 0
    data = json.loads(out.read_text())
    tracks = _check_structure(data)
    assert len(tracks) == 3  # one async track per transfer
    sides = {e["args"]["name"] for e in data["traceEvents"] if e["ph"] == "M"}
    assert sides == {"D0", "P0", "P1"}
    # D's transfer never ended: its spans are closed at the end of the trace, and say so.
    closing = [e for e in data["traceEvents"] if e["ph"] == "e" and e.get("args")]
    assert closing and closing[-1]["args"]["note"] == "still live when the trace ends"
    states = [
        e["name"] for e in data["traceEvents"] if e["ph"] == "b" and e["cat"] == "P1/write_producer"
    ]
    assert states == ["tx-0>d0", "allocated", "scheduling", "sealed", "expired"]


def test_a_bad_trace_leaves_no_half_written_output(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text("not a trace\n")
    out = tmp_path / "trace.json"
    assert main(["export-trace", str(bad), "-o", str(out)]) == 2
    assert not out.exists() and not (tmp_path / "trace.json.partial").exists()

"""Trace files written to hurt the tools that read them: replay, explain and export-trace.

A table line asking for a table of any size, records nested a hundred thousand levels
deep, names holding terminal escapes and line breaks, effects of the wrong type: each
costs a clear error (file:line, one line on stderr, exit 2) or is shown escaped, never a
traceback, a runaway allocation or text that rewrites the terminal.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moriio_fsm.cli import main
from moriio_fsm.machines import build_table
from moriio_fsm.runtime.declared import events
from moriio_fsm.trace import TraceError, TraceRecorder, iter_records, replay
from moriio_fsm.trace.explain import explain

from .conftest import lifecycle

COMMANDS = {
    "replay": lambda path, out: ["replay", str(path)],
    "explain": lambda path, out: ["explain", str(path), "--transfer", "tx-1"],
    "export-trace": lambda path, out: ["export-trace", str(path), "-o", str(out)],
}


def recorded(path: Path, side: str = "P0", transfer: str = "tx-1") -> Path:
    """A clean one-layer WRITE producer transfer, traced into ``path``."""
    recorder = TraceRecorder(side, file=path)
    lifecycle(build_table("write_producer", recorder=recorder), transfer, layers=1)
    recorder.close()
    return path


def rewritten(path: Path, change) -> Path:
    """``path`` with ``change(record)`` applied to every record (a dict) but the header."""
    lines = path.read_text().splitlines()
    records = [json.loads(line) for line in lines[1:]]
    for record in records:
        change(record)
    path.write_text("\n".join([lines[0], *map(json.dumps, records)]) + "\n")
    return path


def table_line(**changes):
    def change(record):
        if record["type"] == "table":
            for section, values in changes.items():
                record[section].update(values)

    return change


def one_error_line(capsys) -> str:
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 1 and "Traceback" not in captured.err, captured.err
    return lines[0]


# -- table options ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "option, value",
    [
        ("shards", 2**26),
        ("ended_capacity", 2**40),
        ("pending_capacity", 2**40),
        ("pending_per_transfer", 2**40),
        ("pending_per_source", 2**40),
        ("shards", 3),
        ("ended_capacity", "many"),
        ("check_invariants", "yes"),
        ("pending_ttl_s", -1.0),
        ("recorder", "mine"),
        ("executor", "transitions"),
    ],
)
def test_a_table_line_asking_for_a_table_a_replay_does_not_build_is_refused_by_name(
    tmp_path, capsys, option, value
):
    path = rewritten(recorded(tmp_path / "t.jsonl"), table_line(options={option: value}))
    with pytest.raises(TraceError) as caught:
        replay([path])
    assert caught.value.line == 2 and repr(option) in caught.value.message
    assert main(["replay", str(path)]) == 2
    error = one_error_line(capsys)
    assert f"{path}:2: table 'write_producer' of side 'P0': " in error and option in error


def test_a_limit_in_the_config_beyond_reason_is_refused_by_name(tmp_path, capsys):
    # max_layers sizes a bitmap per transfer: a layer number it allows is a shift that big.
    path = rewritten(recorded(tmp_path / "t.jsonl"), table_line(config={"max_layers": 2**40}))
    with pytest.raises(TraceError) as caught:
        replay([path])
    assert caught.value.line == 2 and "'max_layers'" in caught.value.message
    assert main(["replay", str(path)]) == 2
    assert "max_layers" in one_error_line(capsys)


def test_options_that_only_tune_housekeeping_are_not_replayed_and_the_rest_are(tmp_path):
    path = rewritten(
        recorded(tmp_path / "t.jsonl"),
        table_line(
            options={
                "timer_compaction_threshold": 2**60,
                "shards": 8,
                "ended_capacity": 1 << 20,
                "pending_per_source": None,
                "check_invariants": True,
            }
        ),
    )
    report = replay([path])
    assert report.ok and report.compared == 6


# -- nesting ------------------------------------------------------------------------------


def nested(depth: int):
    value: list = []
    for _ in range(depth - 1):
        value = [value]
    return value


def deep_step_data(path: Path, depth: int) -> Path:
    """``path`` (line 5: layer_scheduled) with a payload list nested ``depth`` levels,
    written as bytes: json.dumps itself cannot write that deep."""
    lines = path.read_bytes().splitlines(keepends=True)
    index = next(i for i, line in enumerate(lines) if b'"event":"layer_scheduled"' in line)
    lines[index] = lines[index].replace(
        b'"data":{', b'"data":{"deep":' + b"[" * depth + b"]" * depth + b",", 1
    )
    path.write_bytes(b"".join(lines))
    return path


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("depth", [100_000, 900])
def test_a_record_nested_without_end_is_a_trace_error_for_every_command(
    tmp_path, capsys, command, depth
):
    path = deep_step_data(recorded(tmp_path / "t.jsonl"), depth)
    out = tmp_path / "out.json"
    assert main(COMMANDS[command](path, out)) == 2
    error = one_error_line(capsys)
    assert error.startswith(f"moriio-fsm: {path}:5: the record is nested more than 64 levels")
    assert not out.exists() and not Path(f"{out}.partial").exists()


def test_a_table_line_nested_without_end_is_refused_at_its_line(tmp_path, capsys):
    path = recorded(tmp_path / "t.jsonl")
    lines = path.read_bytes().splitlines(keepends=True)
    lines[1] = lines[1].replace(
        b'"options":{', b'"options":{"x":' + b'{"y":' * 50_000 + b"1" + b"}" * 50_000 + b",", 1
    )
    path.write_bytes(b"".join(lines))
    assert main(["replay", str(path)]) == 2
    assert f"{path}:2: the record is nested" in one_error_line(capsys)


def test_records_nested_within_the_limit_are_read_whole(tmp_path):
    path = rewritten(
        recorded(tmp_path / "t.jsonl"),
        lambda r: (
            r.get("data", {}).update({"extra": nested(40)}) if r.get("event") == "seal" else None
        ),
    )
    seal = next(r for _, r in iter_records(path) if getattr(r, "event", "") == "seal")
    assert seal.data["extra"] == nested(40)


# -- explain ------------------------------------------------------------------------------


def expired_then_released(path: Path) -> Path:
    """A transfer the defer timer expires (D's allocation never came), then D's release
    arriving long after it ended."""
    recorder = TraceRecorder("P0", file=path)
    table = build_table("write_producer", recorder=recorder)
    table.dispatch(events.prefill_started("tx-1", 0.0, num_writers=1))
    table.dispatch(events.layer_scheduled("tx-1", 0.1, 0))
    table.dispatch(events.seal("tx-1", 0.2))
    table.dispatch(events.request_finished("tx-1", 1.0))
    table.advance(120.0)
    table.dispatch(events.release("tx-1", 130.0, source="D0"))
    recorder.close()
    return path


def test_explain_names_the_step_that_ended_a_transfer_not_a_late_event_after_it(tmp_path):
    found = explain([expired_then_released(tmp_path / "t.jsonl")], "tx-1")
    why = next(line for line in found.render().splitlines() if line.startswith("why: "))
    assert why.startswith(
        "why: P0/write_producer 'tx-1' ended 'expired' at t=60.000 after "
        "defer_timeout (sealed -> expired)"
    )
    assert "after release" not in why
    assert why.endswith("1 later event(s) found it ended: release at t=130.000 (late).")


def test_names_from_a_trace_are_shown_escaped(tmp_path, capsys):
    side = "P0\x1b]0;owned\x07\nwhy: all fine"
    path = recorded(tmp_path / "t.jsonl", side=side, transfer="tx-1")
    assert main(["explain", str(path), "--transfer", "tx-1"]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out
    assert [line for line in out.splitlines() if line.startswith("why: ")] == [
        "why: P0\\x1b]0;owned\\x07\\nwhy: all fine/write_producer 'tx-1' ended 'released' at "
        "t=0.000 after request_finished (completed -> released) (Success or D's release; P's "
        "blocks were handed back)."
    ]


def test_an_effect_of_the_wrong_shape_is_a_divergence_not_a_crash(tmp_path, capsys):
    def odd_kind(record):
        for effect in record.get("effects", ()):
            effect["kind"] = 5

    path = rewritten(recorded(tmp_path / "t.jsonl"), odd_kind)
    assert main(["explain", str(path), "--transfer", "tx-1"]) == 1
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err and "post_write" not in captured.out
    assert " 5" in next(line for line in captured.out.splitlines() if "layer_scheduled" in line)
